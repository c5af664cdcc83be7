"""ZeRO-Infinity: ZeRO-3 with parameters and optimizer states swapped to NVMe through DeepSpeed's own
swapper (its async_io op, built once per node by the pre-flight), on 2 gloo ranks, against the
single-process reference; killed mid-run, it resumes from a checkpoint to the uninterrupted run's
losses and weights bit for bit, which DeepSpeed alone does not (engine/backends/deepspeed_backend.py
`_load_nvme_optimizer_states`).

DeepSpeed swaps only tensors of at least max(1 MiB, aio.block_size) and keeps smaller ones in host
memory, so a model of the usual test size writes nothing and proves nothing. At n_embd 384 each MLP
matrix's half is 1.1 MiB (swapped) and each attention matrix's 0.84 MiB (kept), and sub-groups of
200k elements put some of the optimizer's states on NVMe and some in memory: both paths, in one model.
The folder must hold swap files once the run has started, and they are counted by `plan`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoints.store import latest_tag, step_tag
from engine.plan import nvme_bytes
from tests.support.compare import (
    CLIPPED_WEIGHT_TOLERANCE,
    LOSS_TOLERANCE,
    assert_grad_norms_match,
    assert_weights_match,
    max_loss_difference,
)
from tests.support.launch import deepspeed_launcher, launch, read_run, run_launcher
from tests.support.memory import assert_plan_matches_measured
from tests.support.reference import ReferenceRun, reference_run

GPT = "configs/tiny_gpt.json"
RESNET = "configs/tiny_resnet.json"
MODEL = {"model.n_embd": 384, "model.n_head": 4, "trainer.max_steps": 6}


def nvme(folder: Path) -> dict[str, object]:
    """ZeRO-3 with the parameters and the optimizer states swapped under `folder`."""
    return {
        **MODEL,
        "zero_optimization.stage": 3,
        "zero_optimization.sub_group_size": 200_000,
        "zero_optimization.offload_optimizer.device": "nvme",
        "zero_optimization.offload_optimizer.nvme_path": str(folder),
        "zero_optimization.offload_optimizer.buffer_count": 4,
        "zero_optimization.offload_param.device": "nvme",
        "zero_optimization.offload_param.nvme_path": str(folder),
        "zero_optimization.offload_param.buffer_count": 5,
        "zero_optimization.offload_param.buffer_size": 400_000,
        # DeepSpeed reads up to max_in_cpu elements back into host memory for good at start-up.
        "zero_optimization.offload_param.max_in_cpu": 0,
    }


@pytest.fixture(scope="module")
def reference() -> ReferenceRun:
    """The single-process run the GPT is held to: offload changes where states live, not the
    arithmetic (the reference steps DeepSpeed's CPU Adam too, as any offloaded run does)."""
    return reference_run(GPT, nvme(Path("/unused")), world_size=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    overrides = {**nvme(folder / "nvme"), "trainer.save_interval": 2}
    launch(GPT, overrides, folder / "run")
    return folder, overrides


def swap_files(folder: Path) -> dict[str, int]:
    return {str(path.relative_to(folder)): path.stat().st_size for path in folder.rglob("*.tensor.swp")}


def assert_matches_reference(
    output_dir: Path, reference: ReferenceRun, config: str, overrides: dict, swap_folder: Path
) -> None:
    """The reference's numbers, and the plan's bytes: what each rank held in memory, and what the
    node wrote to the swap folder."""
    run = read_run(output_dir)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)
    plan = assert_plan_matches_measured(run, config, overrides, world_size=2)
    assert nvme_bytes(plan) == {str(swap_folder): sum(swap_files(swap_folder).values())}


@pytest.mark.launch
def test_parameters_and_optimizer_states_on_nvme_train_as_the_reference(
    uninterrupted: tuple[Path, dict], reference: ReferenceRun
):
    folder, overrides = uninterrupted
    assert_matches_reference(folder / "run", reference, GPT, overrides, folder / "nvme")
    written = swap_files(folder / "nvme")
    for rank in (0, 1):
        assert any(name.startswith(f"zero_stage_3/float32params/rank{rank}/") for name in written), written
        assert any(name.startswith(f"zero_stage_3/optimizer/rank{rank}/") for name in written), written
    # The swap folder is scratch: a checkpoint holds copies of the optimizer's swap files of its own.
    checkpoint = folder / "run" / "checkpoints" / step_tag(6) / "offloaded_tensors"
    assert {path.name for path in checkpoint.iterdir()} == {"rank00", "rank01"}


@pytest.mark.launch
def test_a_resnet_with_parameters_and_optimizer_states_on_nvme_trains_as_the_reference(tmp_path: Path):
    """What a GPT of the usual shapes does not reach: a ResNet is built whole and partitioned on
    `deepspeed.initialize`, where DeepSpeed would swap its fp32 parameters as bf16 on a CPU
    (engine/parallel/zero3_init.py `partition_built`), and its 3x3 convolutions put gradient pieces
    at addresses O_DIRECT cannot read into (engine/backends/nvme_repairs.py). Its many parameters in
    flight at once need more than DeepSpeed's five parameter buffers."""
    overrides = {
        "zero_optimization.stage": 3,
        "zero_optimization.offload_optimizer.device": "nvme",
        "zero_optimization.offload_optimizer.nvme_path": str(tmp_path / "nvme"),
        "zero_optimization.offload_param.device": "nvme",
        "zero_optimization.offload_param.nvme_path": str(tmp_path / "nvme"),
        "zero_optimization.offload_param.max_in_cpu": 0,
        "zero_optimization.offload_param.buffer_count": 20,
        "zero_optimization.offload_param.buffer_size": 2_000_000,
        "trainer.max_steps": 3,
    }
    launch(RESNET, overrides, tmp_path / "run")
    reference = reference_run(RESNET, overrides, world_size=2)
    assert_matches_reference(tmp_path / "run", reference, RESNET, overrides, tmp_path / "nvme")
    written = swap_files(tmp_path / "nvme")
    assert any("/float32params/" in name for name in written) and any("/optimizer/" in name for name in written)


@pytest.mark.launch
def test_a_run_killed_mid_step_resumes_from_nvme_to_the_uninterrupted_weights(
    uninterrupted: tuple[Path, dict], tmp_path: Path
):
    """Killed in step 5, the run's last checkpoint is step 4's, whole. Resumed from step 2 instead, it
    saves step 4 again over the published one (DeepSpeed's own copy of the swap files refuses a folder
    that exists) and trains steps 3-6 to the uninterrupted run's losses and weights exactly: the
    Adam step counts and the sub-groups kept in memory come back as well as the swapped files."""
    straight_folder, overrides = uninterrupted
    overrides = {**overrides, "zero_optimization.offload_optimizer.nvme_path": str(tmp_path / "nvme")}
    overrides["zero_optimization.offload_param.nvme_path"] = str(tmp_path / "nvme")
    killed = run_launcher(
        deepspeed_launcher(2), GPT, overrides, tmp_path / "run", {"ENGINE_FAULT": "kill,rank=1,step=5"}
    )
    assert killed.returncode != 0
    assert latest_tag(tmp_path / "run" / "checkpoints") == step_tag(4)
    resume_from = tmp_path / "run" / "checkpoints" / step_tag(2)
    launch(GPT, {**overrides, "trainer.resume": str(resume_from)}, tmp_path / "run")
    resumed, straight = read_run(tmp_path / "run"), read_run(straight_folder / "run")
    resumed_losses = [record["loss"] for record in resumed.records if record["step"] > 2]
    assert resumed_losses == straight.losses[2:], (resumed_losses, straight.losses)
    final, expected = resumed.exported_state_dict(), straight.exported_state_dict()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
