"""What a step whose loss or gradients are NaN/inf does to a run (`trainer.nonfinite`).

"stop" (the default) ends the run at that step, before anything of it is saved, with one message
naming the step, what was not finite and the last good checkpoint. "skip" counts the step and goes
on, the weights and the LR schedule as they were, until more than `trainer.max_skipped_steps` have
been skipped.

Dropping the update is the optimizer's job, not the loop's: DeepSpeed's ZeRO and mixed-precision
optimizers can test the gradients before every update and drop it when one is not finite (fp16's
loss scaler lives on this), and the accelerate backend runs the same test itself under "skip".
Under fp16 a dropped update with a finite loss is the loss scaler backing off, not a failure: it is
counted and reported, and never stops a run.

"skip" and fp16 decide at every step (`step_health`: one small all-reduce and a host read), since
the next step must know whether this one counted. "stop" needs no decision until something would
leave the process: `DeferredHealth` keeps the first bad step on the device, and the loop reads it
before each log, evaluation and save, so no step pays a host sync for it and the step named is
still the first bad one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.parallel.process_group import all_gather_rows, all_reduce_sum

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


class DeferredHealth:
    """The first step since the run began whose loss (per rank) or gradients were not finite, kept
    on the device; and the first whose update the optimizer dropped, which DeepSpeed counts on the
    host anyway (`engine.skipped_steps`, after its own read of the gradients' norm)."""

    def __init__(self, device: torch.device):
        self._first_bad_loss = torch.zeros((), dtype=torch.int64, device=device)
        self._first_bad_gradients = torch.zeros((), dtype=torch.int64, device=device)
        self._first_dropped = 0

    def record(self, step: int, loss: torch.Tensor, bad_gradients: torch.Tensor | None, dropped: bool) -> None:
        """No host sync: three element-wise kernels on scalars."""
        bad_loss = ~torch.isfinite(loss.detach())
        self._first_bad_loss.masked_fill_(bad_loss & (self._first_bad_loss == 0), step)
        if bad_gradients is not None:
            self._first_bad_gradients.masked_fill_(bad_gradients & (self._first_bad_gradients == 0), step)
        if dropped and not self._first_dropped:
            self._first_dropped = step

    def read(self) -> tuple[int, StepHealth] | None:
        """Collective: the first bad step over every rank and its health, None while all are clean.
        One small all-gather and one host read."""
        local = torch.stack(
            [
                self._first_bad_loss,
                self._first_bad_gradients,
                torch.tensor(self._first_dropped, dtype=torch.int64, device=self._first_bad_loss.device),
            ]
        )
        ranks = [[int(value) for value in row] for row in all_gather_rows(local)]
        bad = [value for row in ranks for value in row if value]
        if not bad:
            return None
        first = min(bad)
        loss_ranks = sum(row[0] == first for row in ranks)
        dropped = any(first in (row[1], row[2]) for row in ranks)
        return first, StepHealth(loss_ranks, dropped)


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
