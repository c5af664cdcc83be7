"""The loss scale that DeepSpeed's ZeRO-0 fp16 optimizers expect and `DeepSpeedEngine.backward` does not apply.

In DeepSpeed 0.19.8, `engine.backward(loss)` multiplies the loss by the scale only for a ZeRO optimizer
(`ZeROOptimizer.scale_if_loss`) or torch_autocast's GradScaler. Without ZeRO, fp16 (and bf16 without
ZeRO) runs `FP16_Optimizer` or `FP16_UnfusedOptimizer`, whose `step` divides the gradients by the scale
all the same: the first GPU run trained 16 steps with the scale stuck at 2**24, no overflow ever seen,
and gradient norms of 1.5e-7. Their own `backward(loss)` scales, but bypasses the engine's
accumulation and hooks, so the engine hands `engine.backward` the loss already scaled, exactly as
those optimizers' `backward` would. `check_internals` fails loudly if a DeepSpeed release starts
scaling these optimizers itself (the loss would then be scaled twice).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from engine.backends.zero_checks import source_of

# What engine.backward scales: ZeRO's optimizers here, nothing else but torch_autocast's GradScaler.
_ZERO_ONLY = "if isinstance(self.optimizer, ZeROOptimizer): loss = self.optimizer.scale_if_loss(loss) elif"


def check_internals() -> None:
    """Raise if `DeepSpeedEngine.backward` no longer scales the loss for ZeRO optimizers alone."""
    if _ZERO_ONLY not in " ".join(source_of(DeepSpeedEngine.backward).split()):
        raise RuntimeError(
            "DeepSpeedEngine.backward no longer scales the loss for ZeRO optimizers alone: "
            "engine/backends/fp16_loss_scale.py must follow this DeepSpeed release"
        )


def needs_scaling(optimizer: object) -> bool:
    """Whether `optimizer` is a ZeRO-0 fp16 optimizer with a loss scale that engine.backward leaves out."""
    if not isinstance(optimizer, FP16_Optimizer | FP16_UnfusedOptimizer):
        return False
    if not optimizer.loss_scale_config.use_grad_scaling or optimizer.custom_loss_scaler:
        return False
    check_internals()
    return True


def scaled(optimizer: FP16_Optimizer | FP16_UnfusedOptimizer, loss: torch.Tensor) -> torch.Tensor:
    """The loss as the optimizer's own `backward` scales it: in fp32, times the current scale."""
    return loss.float() * optimizer.loss_scale
