"""What the machine can do, read before any process group exists, so the config can be checked
(fp16 support, thread counts) and `"auto"` values resolved without starting anything; and the
dense peak FLOP/s of common devices, the denominator of the MFU (`trainer.peak_tflops: "auto"`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from engine.launch.machine_cache import recall, remember


@dataclass(frozen=True)
class Hardware:
    device_type: str  # "cuda" or "cpu"
    bf16_supported: bool
    fp16_supported: bool
    cpu_count: int
    local_world_size: int
    omp_num_threads: int | None = None
    name: str = "CPU"  # torch.cuda.get_device_name() on a GPU: what the peak-FLOPs table matches


@dataclass(frozen=True)
class _Device:
    """What torch tells of the device: the fields of Hardware that cost an import of torch."""

    device_type: str
    bf16_supported: bool
    fp16_supported: bool
    name: str = "CPU"


def _cpu_fp16_supported() -> bool:
    import torch

    # DeepSpeed's CPU accelerator asks oneDNN the same question.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _ask_torch() -> _Device:
    """The device as torch sees it, stored for this boot (engine/launch/machine_cache.py)."""
    import torch

    if torch.cuda.is_available():
        device = _Device("cuda", torch.cuda.is_bf16_supported(), True, torch.cuda.get_device_name())
    else:
        # bf16 runs on any CPU but is emulated and slow on most; it is allowed, never chosen by "auto".
        device = _Device("cpu", True, _cpu_fp16_supported())
    remember("hardware", asdict(device))
    return device


def detect_hardware(local_world_size: int | None = None, *, recalled: bool = False) -> Hardware:
    """Facts about this machine; `local_world_size` defaults to what the launcher says (torchrun's
    LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE). `recalled`: take torch's answers from
    this boot's machine cache where a process that imported torch stored them (`validate`, which
    need not import torch), else ask torch."""
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    omp = os.environ.get("OMP_NUM_THREADS")
    omp_num_threads = int(omp) if omp and omp.isdigit() and int(omp) > 0 else None
    cpu_count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    stored = recall("hardware") if recalled else None
    device = _Device(**stored) if stored else _ask_torch()
    return Hardware(
        device.device_type,
        device.bf16_supported,
        device.fp16_supported,
        cpu_count,
        local_world_size,
        omp_num_threads,
        device.name,
    )


# Dense peak FLOP/s (no 2:4 sparsity) from the vendors' datasheets: NVIDIA A100, H100, H200, L4,
# L40S, A10 and V100 datasheets; NVIDIA Ada Lovelace architecture whitepaper, appendix A (RTX
# 4090, bf16/fp16 with fp32 accumulation, which PyTorch uses); AMD Instinct MI300X datasheet.
# Where a datasheet quotes only the sparse figure, half of it is the dense one. "fp32" is the
# non-tensor-core peak: the engine leaves TF32 matmuls off, PyTorch's default.
_TERA = 1e12
PEAK_FLOPS: Mapping[str, Mapping[str, float]] = {
    "A100": {"bf16": 312 * _TERA, "fp16": 312 * _TERA, "tf32": 156 * _TERA, "fp32": 19.5 * _TERA},
    "H100 SXM": {"bf16": 989.5 * _TERA, "fp16": 989.5 * _TERA, "tf32": 494.5 * _TERA, "fp32": 67 * _TERA},
    "H100 PCIe": {"bf16": 756.5 * _TERA, "fp16": 756.5 * _TERA, "tf32": 378 * _TERA, "fp32": 51 * _TERA},
    "H100 NVL": {"bf16": 835.5 * _TERA, "fp16": 835.5 * _TERA, "tf32": 417.5 * _TERA, "fp32": 60 * _TERA},
    "H200 SXM": {"bf16": 989.5 * _TERA, "fp16": 989.5 * _TERA, "tf32": 494.5 * _TERA, "fp32": 67 * _TERA},
    "H200 NVL": {"bf16": 835.5 * _TERA, "fp16": 835.5 * _TERA, "tf32": 417.5 * _TERA, "fp32": 60 * _TERA},
    "L4": {"bf16": 121 * _TERA, "fp16": 121 * _TERA, "tf32": 60 * _TERA, "fp32": 30.3 * _TERA},
    "L40S": {"bf16": 362.05 * _TERA, "fp16": 362.05 * _TERA, "tf32": 183 * _TERA, "fp32": 91.6 * _TERA},
    "A10": {"bf16": 125 * _TERA, "fp16": 125 * _TERA, "tf32": 62.5 * _TERA, "fp32": 31.2 * _TERA},
    # Volta has fp16 tensor cores only: no bf16, no tf32.
    "V100 SXM2": {"fp16": 125 * _TERA, "fp32": 15.7 * _TERA},
    "V100 PCIe": {"fp16": 112 * _TERA, "fp32": 14 * _TERA},
    "V100S PCIe": {"fp16": 130 * _TERA, "fp32": 16.4 * _TERA},
    "RTX 4090": {"bf16": 165.2 * _TERA, "fp16": 165.2 * _TERA, "tf32": 82.6 * _TERA, "fp32": 82.6 * _TERA},
    "MI300X": {"bf16": 1307.4 * _TERA, "fp16": 1307.4 * _TERA, "tf32": 653.7 * _TERA, "fp32": 163.4 * _TERA},
}
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

# `torch.cuda.get_device_name()` patterns, first match wins: variants sharing a chip name ("H100
# NVL", "H100 PCIe") come before the bare name, which the SXM part reports ("NVIDIA H100 80GB
# HBM3", "NVIDIA H200"). Word boundaries keep "A10" from matching "A100" and "L4" from "L40S";
# the 4090 must end the name, so a laptop part or the cut-down 4090 D claims nothing.
_DEVICE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), product)
    for pattern, product in (
        (r"\bA100\b", "A100"),
        (r"\bH100 NVL\b", "H100 NVL"),
        (r"\bH100 PCIe\b", "H100 PCIe"),
        (r"\bH100\b", "H100 SXM"),
        (r"\bH200 NVL\b", "H200 NVL"),
        (r"\bH200\b", "H200 SXM"),
        (r"\bL4\b", "L4"),
        (r"\bL40S\b", "L40S"),
        (r"\bA10\b", "A10"),
        (r"\bV100S\b", "V100S PCIe"),
        (r"\bV100-SXM2\b", "V100 SXM2"),
        (r"\bV100-PCIE\b", "V100 PCIe"),
        (r"\bRTX 4090$", "RTX 4090"),
        (r"\bMI300X\b", "MI300X"),
    )
)


def device_product(device_name: str) -> str | None:
    """The `PEAK_FLOPS` row for a device name, or None for a CPU or a device not in the table."""
    for pattern, product in _DEVICE_PATTERNS:
        if pattern.search(device_name.strip()):
            return product
    return None


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at `precision`, or None where the engine claims no MFU.

    None for a CPU, an unknown device, or a precision the device has no peak for (bf16 on a V100):
    a guessed peak would make the MFU a number nobody can compare.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; choose one of: {', '.join(PRECISIONS)}")
    product = device_product(device_name)
    return None if product is None else PEAK_FLOPS[product].get(precision)
