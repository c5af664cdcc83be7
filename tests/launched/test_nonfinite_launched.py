"""A NaN loss injected at a chosen step (ENGINE_FAULT=nan) under each `trainer.nonfinite` policy:
"skip" drops exactly that step's update and goes on, "stop" ends the job before the step is saved,
naming it and the last good checkpoint. The policy's decisions are tested without launches in
tests/unit/test_nonfinite.py."""

from __future__ import annotations

import math
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.support.launch import accelerate_env, accelerate_launcher, deepspeed_launcher, read_run, run_launcher

GPT = "configs/tiny_gpt.json"
# A warm-up that climbs at every step from the second on, so a held schedule shows; a save after
# every step, so the weights before and after the poisoned step can be compared.
SKIP_RUN = {
    "trainer.nonfinite": "skip",
    "trainer.max_steps": 4,
    "trainer.save_interval": 1,
    "trainer.export": False,
    "scheduler.type": "WarmupLR",
    "scheduler.params.warmup_min_lr": 0.0001,
    "scheduler.params.warmup_num_steps": 10,
    "scheduler.params.warmup_type": "linear",
}
NAN_AT_STEP_3 = {"ENGINE_FAULT": "nan,rank=1,step=3"}


def launch_with_nan_at_step_3(launcher: str, overrides: dict[str, object], output_dir: Path) -> CompletedProcess:
    if launcher == "deepspeed":
        return run_launcher(deepspeed_launcher(2), GPT, overrides, output_dir, NAN_AT_STEP_3)
    return run_launcher(accelerate_launcher(2), GPT, overrides, output_dir, {**accelerate_env(), **NAN_AT_STEP_3})


def zero_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step{step:08d}")


def dcp_weights(run_dir: Path, step: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    target = tmp_path / f"step{step}.pt"
    dcp_to_torch_save(run_dir / "checkpoints" / f"step{step:08d}", target)
    return torch.load(target, weights_only=False)["model"]


def assert_only_step_3_was_skipped(records: list[dict], weights: dict[int, dict[str, torch.Tensor]]) -> None:
    losses = [record["loss"] for record in records]
    assert [record["step"] for record in records] == [1, 2, 3, 4]
    # metrics.jsonl is strict JSON: the NaN loss is written as null.
    assert losses[2] is None and all(math.isfinite(loss) for loss in losses[:2] + losses[3:])
    assert [record["skipped_steps"] for record in records] == [0, 0, 1, 1]
    lrs = [record["lr"] for record in records]  # the lr each step ran with
    assert lrs[1] < lrs[2] == lrs[3]  # the schedule did not advance over the skipped step
    for name, before in weights[2].items():
        assert torch.equal(weights[3][name], before), name  # step 3 changed nothing
        assert torch.isfinite(weights[4][name]).all(), name
    assert any(not torch.equal(weights[4][name], weights[3][name]) for name in weights[3])  # step 4 trained


@pytest.mark.launch
def test_zero2_skips_the_nan_step_and_trains_on(tmp_path: Path):
    result = launch_with_nan_at_step_3("deepspeed", {**SKIP_RUN, "zero_optimization.stage": 2}, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 3: non-finite loss on 1 rank(s), step skipped (1 skipped so far)" in result.stdout
    weights = {step: zero_weights(tmp_path, step) for step in (2, 3, 4)}
    assert_only_step_3_was_skipped(read_run(tmp_path).records, weights)


@pytest.mark.launch
def test_accelerate_fsdp_skips_the_nan_step_and_trains_on(tmp_path: Path):
    """FSDP without clipping: the norm of sharded gradients, computed only for the test."""
    overrides = {**SKIP_RUN, "zero_optimization.stage": 2, "gradient_clipping": 0}
    result = launch_with_nan_at_step_3("accelerate", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "accelerate backend: fsdp_grad_op" in result.stdout
    weights = {step: dcp_weights(tmp_path, step, tmp_path) for step in (2, 3, 4)}
    assert_only_step_3_was_skipped(read_run(tmp_path).records, weights)


@pytest.mark.launch
def test_stop_ends_the_job_before_the_nan_step_is_saved(tmp_path: Path):
    overrides = {"trainer.max_steps": 6, "trainer.save_interval": 2, "trainer.export": False}
    result = launch_with_nan_at_step_3("deepspeed", overrides, tmp_path)
    assert result.returncode != 0
    expected = (
        'failed: NonFiniteError: step 3: non-finite loss on 1 rank(s) (trainer.nonfinite is "stop"); the run stops '
        f"before saving it. Last good checkpoint: {tmp_path / 'checkpoints' / 'step00000002'}. Resume from it"
    )
    assert expected in result.stderr, result.stderr[-3000:]
    checkpoints = sorted(path.name for path in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step00000002"]
    assert [record["step"] for record in read_run(tmp_path).records] == [1, 2]


@pytest.mark.launch
def test_stop_read_at_the_next_save_names_the_nan_step_under_zero2_bf16(tmp_path: Path):
    """Nothing reads the device between log and save points under "stop": ZeRO-2's norm reads are
    deferred (engine/backends/zero_checks.py) and bf16's overflow check is off, so step 3's NaN
    reaches the weights. The check read before step 4's save still names step 3, and nothing of
    steps 3 and 4 is saved or logged."""
    overrides = {
        "trainer.max_steps": 6,
        "trainer.save_interval": 2,
        "trainer.log_interval": 5,
        "trainer.export": False,
        "zero_optimization.stage": 2,
        "bf16.enabled": True,
    }
    result = launch_with_nan_at_step_3("deepspeed", overrides, tmp_path)
    assert result.returncode != 0
    assert "failed: NonFiniteError: step 3: non-finite loss on 1 rank(s)" in result.stderr, result.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("step*")) == ["step00000002"]
    assert (checkpoints / "latest").read_text().strip() == "step00000002"
    assert not (tmp_path / "metrics.jsonl").exists() or read_run(tmp_path).records == []
