"""Checks that need a CUDA device (NCCL, bf16 on a GPU); skipped where none is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.launch import launch


@pytest.mark.gpu
@pytest.mark.launch
def test_bf16_auto_trains_on_one_gpu_with_nccl(tmp_path: Path):
    run = launch("configs/tiny_gpt.json", {"bf16.enabled": "auto", "zero_optimization.stage": 2}, tmp_path, nproc=1)
    resolved = (tmp_path / "resolved_config.json").read_text()
    assert '"enabled": true' in resolved  # bf16 chosen on a bf16-capable GPU
    assert all(torch.isfinite(torch.tensor(run.losses)))
    exported = run.exported_state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in exported.values())
