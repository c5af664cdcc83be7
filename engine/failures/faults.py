"""Deliberate failures, so tests (and users rehearsing an incident) can see how a job ends.

`ENGINE_FAULT="kill,rank=1,step=3"` makes rank 1 act after optimizer step 3 (`at=save`: in the
checkpoint save of step 3, once its own files are written and before the checkpoint is published):
  kill   SIGKILL itself, as a segfault or the kernel's out-of-memory killer would;
  hang   SIGSTOP itself, as a rank stuck in a driver call or on a lost node would look;
  raise  raise a Python error, as a bug or a bad batch would;
  nan    make that rank's loss NaN in step 3 itself, before backward, so the gradients are NaN too,
         as a bad batch or a diverging run would (trainer.nonfinite decides what follows; under
         pipeline parallelism only last-stage ranks compute a loss; no at=save).
It reads the environment because a failure drill must not need a different config than the run
it rehearses, and every launcher passes the environment on to its ranks.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.base import StepHooks

ENV_VAR = "ENGINE_FAULT"
ACTIONS = ("kill", "hang", "raise", "nan")
POINTS = ("step", "save")


class InjectedFault(RuntimeError):
    """The `raise` action's error."""


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    at: str = "step"


def parse_fault(text: str) -> Fault:
    """Read an ENGINE_FAULT value; a malformed one is a ValueError naming the variable."""
    action, *fields = [part.strip() for part in text.split(",")]
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep or key not in ("rank", "step", "at"):
            raise ValueError(f"{ENV_VAR}: '{field}' is not rank=N, step=N or at=POINT (in '{text}')")
        values[key] = value
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}: action '{action}' is not one of {', '.join(ACTIONS)} (in '{text}')")
    if values.get("at", "step") not in POINTS:
        raise ValueError(f"{ENV_VAR}: at={values['at']} is not one of {', '.join(POINTS)}")
    if action == "nan" and values.get("at", "step") != "step":
        raise ValueError(f"{ENV_VAR}: nan acts on the loss of a step; drop at={values['at']}")
    try:
        return Fault(action, int(values.get("rank", "0")), int(values["step"]), values.get("at", "step"))
    except (KeyError, ValueError):
        raise ValueError(f"{ENV_VAR}: needs integer rank=N and step=N (got '{text}')") from None


def fault_from_env() -> Fault | None:
    text = os.environ.get(ENV_VAR, "").strip()
    return parse_fault(text) if text else None


def inject(fault: Fault | None, rank: int, point: str, step: int) -> None:
    """Act out `fault` if it is due at this rank, point and step (`nan` acts through `loss_hook`)."""
    if fault is None or fault.action == "nan" or (fault.rank, fault.at, fault.step) != (rank, point, step):
        return
    print(f"rank {rank}: {ENV_VAR} injects '{fault.action}' at {point} {step}", flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise InjectedFault(f"{ENV_VAR} raised at {point} {step}")


def loss_hook(fault: Fault | None, rank: int, step: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The `nan` action for this rank's coming step `step`: a hook that makes each loss of the step NaN
    (a backend applies it before backward); None when no `nan` is due then."""
    if fault is None or fault.action != "nan" or (fault.rank, fault.step) != (rank, step):
        return None
    print(f"rank {rank}: {ENV_VAR} injects 'nan' into the loss of step {step}", flush=True)
    return lambda loss: loss * float("nan")


class FaultHooks(StepHooks):
    """A run's hooks when `ENGINE_FAULT` is set (and harmless when it is not): the fault acts out at
    its rank, point and step."""

    def __init__(self, fault: Fault | None, rank: int):
        self.fault, self.rank = fault, rank
        self._loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def before_step(self, step: int) -> None:
        self._loss_hook = loss_hook(self.fault, self.rank, step)

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self._loss_hook is None else self._loss_hook(loss)

    def after_step(self, step: int) -> None:
        inject(self.fault, self.rank, "step", step)

    def before_publish(self, step: int) -> None:
        inject(self.fault, self.rank, "save", step)
