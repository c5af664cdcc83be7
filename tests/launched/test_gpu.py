"""Checks that need a CUDA device (NCCL, bf16 on a GPU); skipped where none is present."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import hostcost
from tests.support.launch import ROOT, launch, launch_accelerate


@pytest.mark.gpu
@pytest.mark.launch
def test_bf16_auto_trains_on_one_gpu_with_nccl(tmp_path: Path):
    run = launch("configs/tiny_gpt.json", {"bf16.enabled": "auto", "zero_optimization.stage": 2}, tmp_path, nproc=1)
    resolved = (tmp_path / "resolved_config.json").read_text()
    assert '"enabled": true' in resolved  # bf16 chosen on a bf16-capable GPU
    assert all(torch.isfinite(torch.tensor(run.losses)))
    exported = run.exported_state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in exported.values())


@pytest.mark.gpu
@pytest.mark.launch
def test_accelerate_fsdp_bf16_trains_on_one_gpu(tmp_path: Path):
    run = launch_accelerate(
        "configs/tiny_gpt.json", {"bf16.enabled": True, "zero_optimization.stage": 3}, tmp_path, nproc=1
    )
    assert "accelerate backend: fsdp_full on 1 process(es)" in run.stdout
    assert all(torch.isfinite(torch.tensor(run.losses)))


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL refuses two ranks on one)")
@pytest.mark.parametrize(
    "parallel",
    [{"parallel.tensor_parallel_size": 2}, {"parallel.pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_model_parallel_bf16_trains_over_nccl(parallel: dict, tmp_path: Path):
    overrides = {**parallel, "bf16.enabled": True, "zero_optimization.stage": 1}
    run = launch("configs/tiny_gpt.json", overrides, tmp_path, nproc=2)
    assert all(torch.isfinite(torch.tensor(run.losses)))
    assert all(tensor.dtype == torch.float32 for tensor in run.exported_state_dict().values())


@pytest.mark.gpu
@pytest.mark.launch
def test_fp16_overflows_are_skipped_by_the_loss_scaler_and_reported(tmp_path: Path):
    """A loss scale of 2**24 overflows fp16 gradients at once: the scaler halves it step by step
    (hysteresis 1), each overflow is counted and reported, and none stops the run under "stop"."""
    overrides = {
        "fp16.enabled": True,
        "fp16.initial_scale_power": 24,
        "fp16.hysteresis": 1,
        "zero_optimization.stage": 2,
        "trainer.max_steps": 16,
    }
    run = launch("configs/tiny_gpt.json", overrides, tmp_path, nproc=1)
    skipped = [record["skipped_steps"] for record in run.records]
    scales = [record["loss_scale"] for record in run.records]
    assert skipped[0] >= 1 and skipped == sorted(skipped)
    assert scales[0] < 2**24 and scales == sorted(scales, reverse=True)
    assert "fp16 gradient overflow, update skipped by the loss scaler" in run.stdout
    assert all(torch.isfinite(torch.tensor(run.losses)))
    assert all(torch.isfinite(tensor).all() for tensor in run.exported_state_dict().values())


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 2], ids=["zero0", "zero2"])
def test_a_quiet_step_never_reads_the_gpu(stage: int, tmp_path: Path):
    """Benchmark 8's count where it matters: on a GPU, with bf16 "auto", the side-stream prefetch and
    DeepSpeed's fused Adam, a step that neither logs, evaluates nor saves reads nothing back."""
    out = tmp_path / "counts-{rank}.json"
    overrides = [*hostcost.COMMON, "bf16.enabled=auto", f"zero_optimization.stage={stage}"]
    overrides += ["optimizer.params.torch_adam=auto", f"trainer.output_dir={tmp_path / 'run'}"]
    command = [sys.executable, "-m", "bench.host_syncs", "--config", str(hostcost.CONFIG), "--out", str(out)]
    command += [arg for value in overrides for arg in ("--set", value)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = json.loads((tmp_path / "counts-0.json").read_text())["engine"]
    assert counts["counted_steps"] > 0 and counts["syncs_per_step"] == 0, counts
