"""What a step whose loss or gradients are NaN/inf does to a run (`trainer.nonfinite`).

"stop" (the default) ends the run at that step, before anything of it is saved, with one message
naming the step, what was not finite and the last good checkpoint. "skip" counts the step and goes
on, the weights and the LR schedule as they were, until more than `trainer.max_skipped_steps` have
been skipped.

Dropping the update is the optimizer's job, not the loop's: DeepSpeed's ZeRO and mixed-precision
optimizers test the gradients before every update and drop it when one is not finite (fp16's loss
scaler lives on this), and the accelerate backend runs the same test itself. The loop only learns,
once per step, whether any rank's loss was not finite and whether the update was dropped, and
applies the policy. Under fp16 a dropped update with a finite loss is the loss scaler backing off,
not a failure: it is counted and reported, and never stops a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.parallel.process_group import all_reduce_sum

STOP, SKIP = "stop", "skip"


class NonFiniteError(RuntimeError):
    """Ends the run: a non-finite step under "stop", or one too many under "skip"."""


@dataclass(frozen=True)
class NonfinitePolicy:
    action: str  # STOP or SKIP
    max_skipped_steps: int  # under SKIP; 0: no limit
    # The last published checkpoint, or None: named in the stop message. A function, so that
    # failures/ need not know how checkpoints are published.
    last_checkpoint: Callable[[], Path | None]


@dataclass(frozen=True)
class StepHealth:
    """One step's outcome, the same on every rank."""

    nonfinite_loss_ranks: int  # ranks whose loss was NaN or inf
    update_dropped: bool  # the optimizer refused the update (non-finite gradients, or an fp16 overflow)


def step_health(loss: torch.Tensor, update_dropped: bool) -> StepHealth:
    """Collective. One 2-element all-reduce and one host sync per step: the price of stopping before a
    bad step is saved and of every rank taking the same decision (a NaN may appear on one rank only)."""
    flags = {
        "nonfinite_loss": (~torch.isfinite(loss.detach())).double(),
        "update_dropped": torch.tensor(float(update_dropped), device=loss.device),
    }
    sums = all_reduce_sum(flags)
    return StepHealth(int(sums["nonfinite_loss"]), sums["update_dropped"] > 0)


class NonfiniteGuard:
    """Applies the policy step by step and counts the updates that were dropped."""

    def __init__(self, policy: NonfinitePolicy):
        self.policy = policy
        self.skipped = 0  # updates dropped in this process, fp16 overflows included (metrics' skipped_steps)
        self._skipped_nonfinite = 0  # of those, the ones max_skipped_steps limits

    def check(self, step: int, health: StepHealth, loss_scale: float | None) -> str | None:
        """The line to log when the step's update was dropped, None for a clean step.

        Raises NonFiniteError when the run must end. `loss_scale` is fp16's, None without a loss scaler.
        """
        if health.update_dropped:
            self.skipped += 1
        if not health.nonfinite_loss_ranks and not health.update_dropped:
            return None
        if not health.nonfinite_loss_ranks and loss_scale is not None:
            return (
                f"step {step}: fp16 gradient overflow, update skipped by the loss scaler (scale now {loss_scale:g}; "
                f"{self.skipped} skipped so far)"
            )
        what = f"loss on {health.nonfinite_loss_ranks} rank(s)" if health.nonfinite_loss_ranks else "gradients"
        if self.policy.action == STOP:
            advice = 'or set trainer.nonfinite to "skip" to step over such steps'
            raise NonFiniteError(self._stop_message(step, what, 'trainer.nonfinite is "stop"', advice))
        if not health.update_dropped:
            reason = "the gradients were finite, so the optimizer applied the update instead of skipping it"
            raise NonFiniteError(self._stop_message(step, what, reason, "or look for a loss term without gradients"))
        self._skipped_nonfinite += 1
        limit = self.policy.max_skipped_steps
        if limit and self._skipped_nonfinite > limit:
            reason = f"{self._skipped_nonfinite} steps skipped, more than trainer.max_skipped_steps {limit}"
            raise NonFiniteError(self._stop_message(step, what, reason, "or raise trainer.max_skipped_steps"))
        return f"step {step}: non-finite {what}, step skipped ({self.skipped} skipped so far)"

    def _stop_message(self, step: int, what: str, reason: str, advice: str) -> str:
        """One line: the failure path shows an error's first line on the terminal."""
        last = self.policy.last_checkpoint()
        if last is None:
            checkpoint, restart = "no checkpoint saved yet", "Start again"
        else:
            checkpoint, restart = str(last), "Resume from it (trainer.resume=true)"
        return (
            f"step {step}: non-finite {what} ({reason}); the run stops before saving it. Last good checkpoint: "
            f"{checkpoint}. {restart} with a lower optimizer.params.lr or gradient_clipping, or check this step's "
            f"data, {advice}."
        )
