"""The `trainer.nonfinite` policy's decisions, in-process: the NaN fault, step health, when "skip"
counts a step and when it stops, and where the config refuses "skip". The launched runs with a NaN
injected at a chosen step are in tests/launched/test_nonfinite_launched.py."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import pytest
import torch

from engine.checkpoints.store import latest_checkpoint
from engine.config import ConfigError, load_config
from engine.failures.faults import Fault, loss_hook, parse_fault
from engine.failures.nonfinite import (
    SKIP,
    STOP,
    NonFiniteError,
    NonfiniteGuard,
    NonfinitePolicy,
    StepHealth,
    step_health,
)
from engine.launch.hardware import Hardware
from tests.support.launch import ROOT

GPT = "configs/tiny_gpt.json"
CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
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
    return NonfinitePolicy(action, max_skipped_steps, partial(latest_checkpoint, tmp_path / "checkpoints"))


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
