"""Stopping early with a save on the layouts test_checkpoints_launched.py does not cover: two
pipeline stages stopped by a signal, and accelerate's FSDP2 stopped by trainer.max_wall_time, each
saving in the background (trainer.async_save) and resumed to the uninterrupted run's losses and
final weights, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoints.store import latest_tag, step_tag
from engine.launch.signals import EXIT_PREEMPTED
from tests.support.launch import (
    accelerate_env,
    accelerate_launcher,
    deepspeed_launcher,
    launch,
    launch_accelerate,
    read_run,
    run_launcher,
)

GPT = "configs/tiny_gpt.json"
BASE = {"model.dropout": 0.1, "trainer.max_steps": 6, "trainer.save_interval": 2}
PIPELINE = {**BASE, "parallel.pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}
FSDP = {**BASE, "trainer.backend": "accelerate", "zero_optimization.stage": 3}
ASYNC = {"trainer.async_save": True}


def assert_resumed_as_uninterrupted(resumed: Path, straight: Path, from_step: int) -> None:
    resumed_run, straight_run = read_run(resumed), read_run(straight)
    later = [record for record in resumed_run.records if record["step"] > from_step]
    assert [record["step"] for record in later] == list(range(from_step + 1, 7))
    assert [record["loss"] for record in later] == straight_run.losses[from_step:]
    final, expected = resumed_run.exported_state_dict(), straight_run.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name


@pytest.mark.launch
def test_pipeline_stages_stopped_by_a_signal_resume_bit_identically(tmp_path: Path):
    straight = launch(GPT, PIPELINE, tmp_path / "straight").output_dir
    stopped_dir = tmp_path / "stopped"
    fault = {"ENGINE_FAULT": "signal,rank=1,step=3,sig=SIGUSR1"}  # the last stage alone
    stopped = run_launcher(deepspeed_launcher(2), GPT, {**PIPELINE, **ASYNC}, stopped_dir, fault)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert latest_tag(stopped_dir / "checkpoints") == step_tag(3)
    launch(GPT, {**PIPELINE, **ASYNC, "trainer.resume": True}, stopped_dir)
    assert_resumed_as_uninterrupted(stopped_dir, straight, from_step=3)


@pytest.mark.launch
def test_accelerate_fsdp_stopped_before_its_wall_time_resumes_bit_identically(tmp_path: Path):
    """A limit of 1 s has passed before the first step ends (start-up alone takes longer), so the run
    saves step 1 (torch's async_save of FSDP2's shards, waited for) and stops, saying how much time it left."""
    straight = launch_accelerate(GPT, FSDP, tmp_path / "straight").output_dir
    stopped_dir = tmp_path / "stopped"
    stopped = run_launcher(
        accelerate_launcher(2), GPT, {**FSDP, **ASYNC, "trainer.max_wall_time": "1s"}, stopped_dir, accelerate_env()
    )
    # torchrun reports a worker's non-zero exit as its own failure (1); the ranks exited 75.
    assert stopped.returncode != 0
    assert latest_tag(stopped_dir / "checkpoints") == step_tag(1)
    assert "trainer.max_wall_time 0:00:01: stopping with 0:00:00 left" in stopped.stdout, stopped.stdout[-3000:]
    assert "saved step 1 and stopped (exit code 75)" in stopped.stdout
    launch_accelerate(GPT, {**FSDP, **ASYNC, "trainer.resume": True}, stopped_dir)
    assert_resumed_as_uninterrupted(stopped_dir, straight, from_step=1)
