"""What DeepSpeed's ZeRO-0 fp16 optimizers get wrong about their own loss scale, put right around them.

Without ZeRO, DeepSpeed 0.19.8 runs fp16 through `FP16_Optimizer` (under FusedAdam) or
`FP16_UnfusedOptimizer` (under torch's Adam, the default), and three things go wrong, each seen on an
H100 or read in its source:

- `engine.backward(loss)` multiplies the loss by the scale only for a ZeRO optimizer
  (`ZeROOptimizer.scale_if_loss`) or torch_autocast's GradScaler, while these optimizers' `step` still
  divides the gradients by it: the first GPU run trained 16 steps with the scale stuck at 2**24, no
  overflow ever seen, and gradient norms of 1.5e-7. The engine hands `engine.backward` the loss
  already scaled, exactly as the optimizers' own `backward` would (it bypasses the engine's
  accumulation and hooks, so it is not called).
- Both `step`s raise the scale (`_update_scale(False)`, every `loss_scale_window` clean steps) before
  they unscale the gradients with it, so each step that raises the scale applies half its update. The
  engine defers the optimizer's scale updates to the end of its step, in the order it asked for them.
- `FP16_UnfusedOptimizer` reports the scaled gradient norm (times 65,536 at the default scale); the
  engine divides it by the scale the step ran at.

`check_internals` fails loudly when a DeepSpeed release moves what this module relies on.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from engine.backends.zero_checks import source_of

# Source fragments (whitespace collapsed) whose behaviour this module makes up for.
_FRAGMENTS = (
    (
        DeepSpeedEngine.backward,
        "if isinstance(self.optimizer, ZeROOptimizer): loss = self.optimizer.scale_if_loss(loss) elif",
    ),
    (FP16_Optimizer.step, "self._update_scale(False) # Stash unscaled gradient norm"),
    (FP16_UnfusedOptimizer.step, "self._global_grad_norm = get_global_norm(norm_list=norm_groups)"),
    (FP16_UnfusedOptimizer.step, "self._update_scale(False) self.unscale_and_clip_grads(self._global_grad_norm)"),
)


def check_internals() -> None:
    """Raise if DeepSpeed no longer does what this module makes up for."""
    for function, fragment in _FRAGMENTS:
        if fragment not in " ".join(source_of(function).split()):
            raise RuntimeError(
                f"{function.__qualname__} no longer runs `{fragment}`: engine/backends/fp16_loss_scale.py must "
                "follow this DeepSpeed release"
            )


class Fp16WithoutZero:
    """The engine's side of one ZeRO-0 fp16 optimizer: the scaled loss for backward, the optimizer's
    scale updates applied after its step, and the norm it reports unscaled."""

    def __init__(self, optimizer: FP16_Optimizer | FP16_UnfusedOptimizer):
        check_internals()
        self.optimizer = optimizer
        self._update_scale = optimizer._update_scale
        self._pending: list[bool] = []
        # An instance attribute: the optimizer's `step` calls it by name, DeepSpeed's code untouched.
        optimizer._update_scale = self._pending.append
        self._norm_scale = 1.0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss as the optimizer's own `backward` scales it: in fp32, times the current scale."""
        return loss.float() * self.optimizer.loss_scale

    def after_step(self) -> None:
        """After `engine.step()`: where the optimizer stepped, note the scale its gradients carried,
        then apply the scale updates it asked for."""
        if not self._pending:
            return
        if isinstance(self.optimizer, FP16_UnfusedOptimizer):
            self._norm_scale = self.optimizer.loss_scale
        for skipped in self._pending:
            self._update_scale(skipped)
        self._pending.clear()

    def unscaled_norm(self, norm: float) -> float:
        """The last step's gradient norm as DeepSpeed reported it, without the loss scale."""
        return norm / self._norm_scale


def fp16_without_zero(optimizer: object) -> Fp16WithoutZero | None:
    """The repairs for `optimizer` where it is a ZeRO-0 fp16 optimizer with a loss scale, else None."""
    if not isinstance(optimizer, FP16_Optimizer | FP16_UnfusedOptimizer):
        return None
    if not optimizer.loss_scale_config.use_grad_scaling or optimizer.custom_loss_scaler:
        return None
    return Fp16WithoutZero(optimizer)
