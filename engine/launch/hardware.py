"""What the machine can do, read before any process group exists, so the config can be checked
(fp16 support, thread counts) and `"auto"` values resolved without starting anything."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Hardware:
    device_type: str  # "cuda" or "cpu"
    bf16_supported: bool
    fp16_supported: bool
    cpu_count: int
    local_world_size: int
    omp_num_threads: int | None = None
    name: str = "CPU"  # torch.cuda.get_device_name() on a GPU: what the peak-FLOPs table matches


def _cpu_fp16_supported() -> bool:
    # DeepSpeed's CPU accelerator asks oneDNN the same question.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def detect_hardware(local_world_size: int | None = None) -> Hardware:
    """Facts about this machine; `local_world_size` defaults to what the launcher says (torchrun's
    LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE)."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    omp = os.environ.get("OMP_NUM_THREADS")
    omp_num_threads = int(omp) if omp and omp.isdigit() and int(omp) > 0 else None
    cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.cuda.is_available():
        return Hardware(
            "cuda",
            torch.cuda.is_bf16_supported(),
            True,
            cpu_count,
            local_world_size,
            omp_num_threads,
            torch.cuda.get_device_name(),
        )
    # bf16 runs on any CPU but is emulated and slow on most; it is allowed, never chosen by "auto".
    return Hardware("cpu", True, _cpu_fp16_supported(), cpu_count, local_world_size, omp_num_threads)
