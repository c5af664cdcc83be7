"""trainer.async_save's writers: what a save hands to the writer process is a copy the next steps
cannot change, written as the synchronous save writes it; a failed write or a dead writer is raised
to the rank; torch distributed checkpoint's async_save stages a copy too; and a checkpoint.writer
beside it is refused before anything starts."""

from __future__ import annotations

import os
import signal
import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from torch.distributed.checkpoint import FileSystemWriter

from engine.checkpoints.background import BackgroundCheckpointEngine, BackgroundWriter
from engine.checkpoints.packing import Slot, pack, rebuild
from engine.config.errors import ConfigError
from engine.config.load import load_config
from engine.launch.hardware import Hardware
from tests.support.launch import ROOT
from tests.support.process_group import world_of_one  # noqa: F401 (a fixture: pytest finds it by name)

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=1)
LARGE = 300_000  # floats: over 1 MB, so in shared memory of its own


def live_state() -> dict:
    """Shaped as DeepSpeed's model states: a module state_dict with its versions and a tied weight,
    optimizer moments, parameter shapes and the fp16 loss scaler."""
    module = torch.nn.Linear(4, 4)
    state_dict = module.state_dict()
    state_dict["tied"] = state_dict["weight"]
    scaler = DynamicLossScaler(2.0**16, 10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    return {
        "module": state_dict,
        "optimizer": {"state": {0: {"exp_avg": torch.ones(LARGE), "step": torch.tensor(4.0)}}, "lr": [0.1]},
        "param_shapes": [OrderedDict(weight=torch.Size([4, 4]))],
        "scaler": scaler,
    }


def test_a_packed_state_shares_nothing_with_the_live_one_and_keeps_its_shape():
    live = live_state()
    expected = {"weight": live["module"]["weight"].clone(), "exp_avg": torch.ones(LARGE)}
    packed = pack(live)
    live["module"]["weight"].data.add_(1.0)
    live["optimizer"]["state"][0]["exp_avg"].mul_(7.0)
    live["optimizer"]["lr"][0] = 0.2
    live["scaler"].cur_scale = 1.0
    skeleton = packed.skeleton
    large = skeleton["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(large, expected["exp_avg"]) and large.is_shared()
    assert isinstance(skeleton["module"]["weight"], Slot)
    rebuilt = rebuild(skeleton, packed.small)
    assert torch.equal(rebuilt["module"]["weight"], expected["weight"])
    assert rebuilt["module"]["tied"] is rebuilt["module"]["weight"]  # saved once, as torch.save keeps a tied weight
    assert rebuilt["module"]._metadata == live["module"]._metadata  # the versions load_state_dict reads
    assert type(rebuilt["param_shapes"][0]["weight"]) is torch.Size
    assert rebuilt["optimizer"]["lr"] == [0.1] and rebuilt["scaler"].cur_scale == 2.0**16


def test_the_writer_process_writes_what_a_synchronous_save_writes(tmp_path: Path):
    """The same state saved by DeepSpeed's torch.save engine and by the background engine loads the
    same: values, types, storage sharing and the state_dict's versions."""
    state, written = live_state(), []
    TorchCheckpointEngine(None).save(state, str(tmp_path / "sync.pt"))
    engine = BackgroundCheckpointEngine(None, BackgroundWriter(), written.append)
    engine.create(CheckpointCommitInfo(tag="step00000004.partial", save_dir=str(tmp_path), save_latest=False))
    engine.save(state, str(tmp_path / "async.pt"))
    engine.save({"second": torch.zeros(2)}, str(tmp_path / "second.pt"))
    assert engine.commit(CheckpointCommitInfo("step00000004.partial", str(tmp_path), False))
    engine.writer.wait()
    assert engine.writer.done() and written == [4]  # once per save, after its first file
    sync, background = (torch.load(tmp_path / name, weights_only=False) for name in ("sync.pt", "async.pt"))
    assert background["module"]._metadata == sync["module"]._metadata
    assert background["module"]["tied"].untyped_storage().data_ptr() == background["module"]["weight"].data_ptr()
    assert torch.equal(background["optimizer"]["state"][0]["exp_avg"], sync["optimizer"]["state"][0]["exp_avg"])
    assert background["param_shapes"] == sync["param_shapes"] and background["scaler"].cur_scale == 2.0**16
    assert not engine.preserves_storage_sharing()


def test_a_failed_write_and_a_dead_writer_are_raised_on_the_rank(tmp_path: Path):
    writer = BackgroundWriter()
    writer.wait_ready()
    os.kill(writer._process.pid, signal.SIGTERM)  # a scheduler's, to every process of the job: ignored
    writer.submit({"x": torch.zeros(2)}, str(tmp_path / "x.pt"), zipfile=True)
    writer.wait()
    writer.submit({"x": torch.zeros(2)}, str(tmp_path / "missing" / "x.pt"), zipfile=True)
    with pytest.raises(RuntimeError, match=r"a checkpoint write failed: .*missing/x.pt: RuntimeError: Parent"):
        writer.wait()
    assert writer.done() and writer._process.is_alive()  # the failure was reported once; the writer goes on
    os.kill(writer._process.pid, signal.SIGKILL)
    writer._process.join()
    writer.submit({"x": torch.zeros(2)}, str(tmp_path / "y.pt"), zipfile=True)  # a new writer, nothing in flight
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "y.pt")["x"], torch.zeros(2))
    os.kill(writer._process.pid, signal.SIGSTOP)  # so that the next file cannot be written before it dies
    writer.submit({"x": torch.zeros(2)}, str(tmp_path / "z.pt"), zipfile=True)
    os.kill(writer._process.pid, signal.SIGKILL)
    writer._process.join()
    with pytest.raises(RuntimeError, match=r"the checkpoint writer process died \(exit code -9\) with 1 files"):
        writer.wait()


class GatedWriter(FileSystemWriter):
    """Holds the write until the test lets it go: the training moves on meanwhile."""

    def __init__(self, path: str, gate: threading.Event):
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        self.gate.wait()
        return super().write_data(plan, planner)


@pytest.mark.usefixtures("world_of_one")
def test_torch_async_save_writes_the_state_staged_when_it_was_called(tmp_path: Path):
    """The accelerate backend's path: on CPU the staged copy must not be the live tensor either."""
    model = torch.nn.Linear(4, 2)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    gate = threading.Event()
    upload = dcp.async_save({"model": model.state_dict()}, storage_writer=GatedWriter(str(tmp_path), gate))
    with torch.no_grad():
        model.weight.add_(1.0)
    gate.set()
    upload.result()
    restored = {"model": {name: torch.empty_like(tensor) for name, tensor in before.items()}}
    dcp.load(restored, checkpoint_id=str(tmp_path))
    for name, tensor in before.items():
        assert torch.equal(restored["model"][name], tensor), name


def test_a_fastpersist_writer_beside_async_save_is_refused(tmp_path: Path):
    overrides = [f"trainer.output_dir={tmp_path}", "trainer.async_save=true", 'checkpoint.writer={"type": "fast"}']
    with pytest.raises(ConfigError, match=r"trainer.async_save: checkpoint.writer selects DeepSpeed's FastPersist"):
        load_config(ROOT / "configs/tiny_gpt.json", overrides, world_size=2, hardware=CPU)


def test_deepspeeds_decoupled_writer_is_refused_for_the_publish_it_would_outrun(tmp_path: Path):
    overrides = [f"trainer.output_dir={tmp_path}", 'checkpoint.writer={"decoupled": true}']
    with pytest.raises(ConfigError, match=r"checkpoint.writer.decoupled: .* set trainer.async_save instead"):
        load_config(ROOT / "configs/tiny_gpt.json", overrides, world_size=2, hardware=CPU)
