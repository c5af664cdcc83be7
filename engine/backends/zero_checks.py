"""DeepSpeed's ZeRO optimizers without their per-step read of the gradients' norm.

Before each update, ZeRO-1/2 (`DeepSpeedZeroOptimizer.step`, and `unscale_and_clip_grads` once per
parameter group when clipping) and ZeRO-3 (`DeepSpeedZeroOptimizer_Stage3.step`) ask
`is_invalid_grad_norm(norm)`, which turns the norm into a Python bool: a host read of the device, so
the host cannot queue the next step while the GPU finishes this one (3 reads a step for a clipped
fp32 ZeRO-1 run of two parameter groups, bench/hostcost.py). The answer only decides whether to drop
the update, which `trainer.nonfinite: "skip"` needs and fp16's loss scaler lives on. Under "stop" the
engine reads the same norm on the device instead (`Backend.nonfinite_gradients`, read by the loop
before anything is logged or saved), so a bad step still ends the run before it is saved.

There is no DeepSpeed switch for this (bf16's `check_grad_overflow` turns off the overflow test but
not these reads), so the engine replaces the name `is_invalid_grad_norm` in the two ZeRO modules with
one that answers "valid" for a tensor without reading it, and defers to DeepSpeed for a Python
number (no device read there). `check_internals` fails loudly when a DeepSpeed release moves the reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime import utils as deepspeed_utils
from deepspeed.runtime.zero import stage3, stage_1_and_2

from engine.backends.base import BackendSettings

# Module -> the source fragments whose reads the replacement removes.
READS = {
    stage_1_and_2: (
        (stage_1_and_2.DeepSpeedZeroOptimizer.step, "is_invalid_grad_norm(scaled_global_grad_norm)"),
        (stage_1_and_2.DeepSpeedZeroOptimizer.unscale_and_clip_grads, "is_invalid_grad_norm(clip_norm)"),
    ),
    stage3: ((stage3.DeepSpeedZeroOptimizer_Stage3.step, "is_invalid_grad_norm(scaled_global_grad_norm)"),),
}
_ORIGINAL = deepspeed_utils.is_invalid_grad_norm


def _unread_norm_is_valid(norm: Any) -> bool:
    """DeepSpeed's test for a number; a tensor stays on the device, its validity read by the loop."""
    if torch.is_tensor(norm):
        return False
    return _ORIGINAL(norm)


def check_internals() -> None:
    """Raise if the reads this module removes are no longer where it removes them."""
    for module, places in READS.items():
        if getattr(module, "is_invalid_grad_norm", None) not in (_ORIGINAL, _unread_norm_is_valid):
            raise RuntimeError(
                f"{module.__name__} no longer imports deepspeed.runtime.utils.is_invalid_grad_norm: "
                "engine/backends/zero_checks.py must follow this DeepSpeed release"
            )
        for function, fragment in places:
            if fragment not in source_of(function):
                raise RuntimeError(
                    f"{function.__qualname__} no longer calls {fragment}: engine/backends/zero_checks.py must "
                    "follow this DeepSpeed release"
                )


def source_of(function: Callable[..., Any]) -> str:
    """The source of `function`, or of the function a decorator wraps (DeepSpeed's `instrument_w_nvtx`
    keeps it in a closure, without `functools.wraps`)."""
    for cell in function.__closure__ or ():
        if inspect.isfunction(cell.cell_contents):
            return source_of(cell.cell_contents)
    return inspect.getsource(function)


def defer_norm_checks(settings: BackendSettings) -> bool:
    """Under "stop", without fp16's loss scaler and with a ZeRO optimizer: replace the ZeRO modules'
    `is_invalid_grad_norm` (this process runs one engine). Whether it did."""
    if settings.nonfinite != "stop" or settings.precision == "fp16" or settings.zero_stage == 0:
        return False
    check_internals()
    for module in READS:
        module.is_invalid_grad_norm = _unread_norm_is_valid
    return True
