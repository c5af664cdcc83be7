"""trainer.async_save's writers: what a save hands to its thread is a copy the next steps cannot
change, a failed write is raised to the training thread, torch distributed checkpoint's async_save
stages a copy too, and a checkpoint.writer beside it is refused before anything starts."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from engine.checkpoints.background import BackgroundWriter, HookedFileSystemWriter, ThreadedCheckpointEngine, host_copy
from engine.config.errors import ConfigError
from engine.config.load import load_config
from engine.launch.hardware import Hardware
from engine.parallel.process_group import destroy_process_group, init_process_group
from tests.support.launch import ROOT, free_port

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=1)


def test_a_host_copy_shares_nothing_with_the_live_state():
    weight = torch.arange(6.0)
    scaler = DynamicLossScaler(2.0**16, 10, min_scale=1, delayed_shift=2, consecutive_hysteresis=False)
    live = {"module": OrderedDict(weight=weight, view=weight[2:4]), "groups": [{"lr": 0.1}], "scaler": scaler}
    copied = host_copy(live)
    weight.add_(100.0)
    live["groups"][0]["lr"] = 0.2
    scaler.cur_scale = 1.0
    assert torch.equal(copied["module"]["weight"], torch.arange(6.0))
    assert torch.equal(copied["module"]["view"], torch.tensor([2.0, 3.0]))
    # Each tensor in storage of its own, as DeepSpeed's clone for torch.save makes them: a view saves 2 elements.
    assert copied["module"]["view"].untyped_storage().size() == 2 * 4
    assert type(copied["module"]) is OrderedDict and copied["groups"][0]["lr"] == 0.1
    assert copied["scaler"].cur_scale == 2.0**16


def test_the_writer_runs_writes_in_order_and_raises_a_failed_one():
    writer, order, gate = BackgroundWriter(), [], threading.Event()
    writer.submit(lambda: (gate.wait(), order.append(1)))
    writer.submit(lambda: order.append(2))
    assert not writer.done()
    gate.set()
    writer.wait()
    assert writer.done() and order == [1, 2]

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(full_disk)
    with pytest.raises(RuntimeError, match="a checkpoint write failed: .*No space left on device"):
        writer.wait()


def test_deepspeeds_save_through_the_threaded_engine_writes_the_state_as_it_was(tmp_path: Path):
    written: list[int] = []
    engine = ThreadedCheckpointEngine(None, written.append)
    engine.create(CheckpointCommitInfo(tag="step00000004.partial", save_dir=str(tmp_path), save_latest=False))
    moments = torch.ones(3)
    engine.save({"exp_avg": moments, "step": 4}, str(tmp_path / "optim.pt"))
    engine.save({"module": torch.zeros(2)}, str(tmp_path / "model.pt"))
    moments.mul_(7.0)  # the next optimizer step, while the writer may still be at work
    assert engine.commit(CheckpointCommitInfo("step00000004.partial", str(tmp_path), False))
    engine.writer.wait()
    saved = torch.load(tmp_path / "optim.pt", weights_only=False)
    assert torch.equal(saved["exp_avg"], torch.ones(3)) and saved["step"] == 4
    assert (tmp_path / "model.pt").is_file()
    assert written == [4]  # once per save, after its first file
    assert not engine.preserves_storage_sharing()


@pytest.fixture
def one_process_group():
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            patch.setenv(name, value)
        patch.setenv("MASTER_PORT", str(free_port()))
        init_process_group("cpu")
        try:
            yield
        finally:
            destroy_process_group()


class GatedWriter(HookedFileSystemWriter):
    """Holds the write until the test lets it go: the training moves on meanwhile."""

    def __init__(self, path: str, gate: threading.Event):
        super().__init__(path, 4, lambda step: None)
        self.gate = gate

    def write_data(self, plan, planner):
        self.gate.wait()
        return super().write_data(plan, planner)


def test_torch_async_save_writes_the_state_staged_when_it_was_called(one_process_group, tmp_path: Path):
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
