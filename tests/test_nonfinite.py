"""A NaN loss injected at a chosen step (ENGINE_FAULT=nan) under each `trainer.nonfinite` policy:
"skip" drops exactly that step's update and goes on, "stop" ends the job before the step is saved,
naming it and the last good checkpoint. The policy's decisions are unit-tested without launches."""

from __future__ import annotations

import math
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from engine.config import ConfigError, load_config
from engine.failures.faults import Fault, loss_hook, parse_fault
from engine.hardware import Hardware
from engine.nonfinite import SKIP, STOP, NonFiniteError, NonfiniteGuard, NonfinitePolicy, StepHealth, step_health
from tests.support.launch import (
    ROOT,
    accelerate_env,
    accelerate_launcher,
    deepspeed_launcher,
    read_run,
    run_launcher,
)

GPT = "configs/tiny_gpt.json"
CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
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
CLEAN = StepHealth(nonfinite_loss_ranks=0, update_dropped=False)
NAN_LOSS = StepHealth(nonfinite_loss_ranks=1, update_dropped=True)
OVERFLOW = StepHealth(nonfinite_loss_ranks=0, update_dropped=True)


def test_nan_fault_parses_and_poisons_only_its_rank_and_step(capsys: pytest.CaptureFixture):
    fault = parse_fault("nan,rank=1,step=3")
    assert fault == Fault("nan", 1, 3)
    assert loss_hook(fault, rank=0, step=3) is None and loss_hook(fault, rank=1, step=2) is None
    assert loss_hook(parse_fault("raise,rank=1,step=3"), rank=1, step=3) is None
    hook = loss_hook(fault, rank=1, step=3)
    assert math.isnan(hook(torch.tensor(2.0)).item())
    assert "ENGINE_FAULT injects 'nan' into the loss of step 3" in capsys.readouterr().out
    with pytest.raises(ValueError, match="nan acts on the loss of a step; drop at=save"):
        parse_fault("nan,rank=1,step=3,at=save")


def test_step_health_without_a_process_group():
    assert step_health(torch.tensor(1.5), update_dropped=False) == CLEAN
    assert step_health(torch.tensor(float("inf")), update_dropped=True) == NAN_LOSS


def policy(action: str, tmp_path: Path, max_skipped_steps: int = 0) -> NonfinitePolicy:
    return NonfinitePolicy(action, max_skipped_steps, tmp_path / "checkpoints")


def test_stop_names_the_step_and_the_last_good_checkpoint(tmp_path: Path):
    guard = NonfiniteGuard(policy(STOP, tmp_path))
    assert guard.check(1, CLEAN, loss_scale=None) is None
    with pytest.raises(NonFiniteError, match="step 2: non-finite loss on 1 rank.*no checkpoint saved yet. Start again"):
        guard.check(2, NAN_LOSS, loss_scale=None)
    (tmp_path / "checkpoints" / "step00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step00000004")
    with pytest.raises(NonFiniteError) as caught:
        guard.check(5, OVERFLOW, loss_scale=None)  # fp32: a dropped update means non-finite gradients
    message = str(caught.value)
    assert message.startswith("step 5: non-finite gradients") and "\n" not in message
    assert f"Last good checkpoint: {tmp_path / 'checkpoints' / 'step00000004'}. Resume from it" in message


def test_skip_counts_up_to_the_limit_and_fp16_overflows_do_not_count(tmp_path: Path):
    guard = NonfiniteGuard(policy(SKIP, tmp_path, max_skipped_steps=2))
    assert guard.check(1, NAN_LOSS, None) == "step 1: non-finite loss on 1 rank(s), step skipped (1 skipped so far)"
    note = guard.check(2, OVERFLOW, loss_scale=1024.0)
    assert (
        note == "step 2: fp16 gradient overflow, update skipped by the loss scaler (scale now 1024; 2 skipped so far)"
    )
    assert guard.check(3, NAN_LOSS, 512.0).endswith("(3 skipped so far)")
    with pytest.raises(NonFiniteError, match="3 steps skipped, more than trainer.max_skipped_steps 2"):
        guard.check(4, NAN_LOSS, None)


def test_skip_stops_when_the_optimizer_applied_a_non_finite_step(tmp_path: Path):
    guard = NonfiniteGuard(policy(SKIP, tmp_path))
    with pytest.raises(NonFiniteError, match="the optimizer applied the update instead of skipping it"):
        guard.check(7, StepHealth(nonfinite_loss_ranks=2, update_dropped=False), None)


def nonfinite_config(overrides: dict[str, object]):
    return load_config(ROOT / GPT, [f"{key}={value}" for key, value in overrides.items()], world_size=2, hardware=CPU)


def test_skip_is_refused_where_the_optimizer_applies_nan_gradients():
    with pytest.raises(ConfigError) as caught:
        nonfinite_config({"trainer.nonfinite": "skip", "trainer.backend": "deepspeed"})
    assert "trainer.nonfinite" in str(caught.value) and "fp32 ZeRO-0" in str(caught.value)
    for layout in (
        {"zero_optimization.stage": 1},
        {"bf16.enabled": "true"},
        {"trainer.backend": "accelerate"},
    ):
        nonfinite_config({"trainer.nonfinite": "skip", "trainer.backend": "deepspeed", **layout})


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
