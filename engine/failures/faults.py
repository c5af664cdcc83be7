"""Deliberate failures, so tests (and users rehearsing an incident) can see how a job ends.

`ENGINE_FAULT="kill,rank=1,step=3"` makes rank 1 act after optimizer step 3 (`at=save`: in the
checkpoint save of step 3, once its own files are written and before the checkpoint is published;
`at=write`: once the first file of that save has gone to the background writer (trainer.async_save);
`at=eval`: as the evaluation after step 3 starts; `at=export`: as the export of step 3, the last, starts):
  kill   SIGKILL itself, as a segfault or the kernel's out-of-memory killer would;
  hang   SIGSTOP itself, as a rank stuck in a driver call or on a lost node would look;
  raise  raise a Python error, as a bug or a bad batch would;
  nan    make that rank's loss NaN in step 3 itself, before backward, so the gradients are NaN too,
         as a bad batch or a diverging run would (trainer.nonfinite decides what follows; under
         pipeline parallelism only last-stage ranks compute a loss; no at=save).
  signal send `sig=NAME` (SIGTERM by default) to itself, or with `to=launcher` to the launcher that
         started it, or with `to=top` to the command the user typed (the `deepspeed` runner above
         that launcher, else the launcher), as a scheduler preempting the job would; sent up, it
         waits (at most 10 s) for the signal to come back down to the rank, so the run stops at that
         step whichever way it travels; `times=2` sends a second one 3 s later and waits 3 s more
         where it is (the step or the save it interrupts).
It reads the environment because a failure drill must not need a different config than the run
it rehearses, and every launcher passes the environment on to its ranks.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.base import StepHooks
from engine.failures.preemption import signal_received
from engine.launch.detect import LAUNCHER_PID_ENV, TOP_PID_ENV

ENV_VAR = "ENGINE_FAULT"
ACTIONS = ("kill", "hang", "raise", "nan", "signal")
POINTS = ("step", "save", "eval", "write", "export")
# Longer than the window in which copies of one signal count once (engine/failures/preemption.py).
_SECOND_SIGNAL_AFTER_S = 3.0
# The most a signal sent up waits to come back: the supervisors notice a `deepspeed` runner gone
# within their 1 s check (engine/failures/supervise.py).
_COMES_BACK_S = 10.0
# Where `to=` sends the signal: the variable naming that process, None for the rank itself.
_TARGETS = {"self": None, "launcher": LAUNCHER_PID_ENV, "top": TOP_PID_ENV}


class InjectedFault(RuntimeError):
    """The `raise` action's error."""


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    at: str = "step"
    sig: str = "SIGTERM"  # the signal action's
    to: str = "self"  # "self", "launcher" or "top"
    times: int = 1


def parse_fault(text: str) -> Fault:
    """Read an ENGINE_FAULT value; a malformed one is a ValueError naming the variable."""
    action, *fields = [part.strip() for part in text.split(",")]
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep or key not in ("rank", "step", "at", "sig", "to", "times"):
            raise ValueError(
                f"{ENV_VAR}: '{field}' is not rank=N, step=N or at=POINT (or sig=, to=, times= of signal) (in '{text}')"
            )
        values[key] = value
    if action not in ACTIONS:
        raise ValueError(f"{ENV_VAR}: action '{action}' is not one of {', '.join(ACTIONS)} (in '{text}')")
    if values.get("at", "step") not in POINTS:
        raise ValueError(f"{ENV_VAR}: at={values['at']} is not one of {', '.join(POINTS)}")
    if action == "nan" and values.get("at", "step") != "step":
        raise ValueError(f"{ENV_VAR}: nan acts on the loss of a step; drop at={values['at']}")
    if values.get("to", "self") not in _TARGETS:
        raise ValueError(f"{ENV_VAR}: to={values['to']} is not self, launcher or top")
    try:
        return Fault(
            action,
            int(values.get("rank", "0")),
            int(values["step"]),
            values.get("at", "step"),
            values.get("sig", "SIGTERM"),
            values.get("to", "self"),
            int(values.get("times", "1")),
        )
    except (KeyError, ValueError):
        raise ValueError(f"{ENV_VAR}: needs integer rank=N and step=N (and times=N) (got '{text}')") from None


def fault_from_env() -> Fault | None:
    text = os.environ.get(ENV_VAR, "").strip()
    return parse_fault(text) if text else None


def inject(fault: Fault | None, rank: int, point: str, step: int) -> None:
    """Act out `fault` if it is due at this rank, point and step (`nan` acts through `loss_hook`)."""
    if fault is None or fault.action == "nan" or (fault.rank, fault.at, fault.step) != (rank, point, step):
        return
    print(f"rank {rank}: {ENV_VAR} injects '{fault.action}' at {point} {step}", flush=True)
    if fault.action == "signal":
        send_signals(fault)
    elif fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise InjectedFault(f"{ENV_VAR} raised at {point} {step}")


def send_signals(fault: Fault) -> None:
    """The `signal` action: `fault.times` copies of `fault.sig` to this rank, its launcher or the
    command the user typed (a rank without a supervisor: its parent)."""
    variable = _TARGETS[fault.to]
    pid = os.getpid() if variable is None else int(os.environ.get(variable, os.getppid()))
    for copy in range(fault.times):
        if copy:
            time.sleep(_SECOND_SIGNAL_AFTER_S)
        os.kill(pid, signal.Signals[fault.sig])
    if fault.times > 1:
        time.sleep(_SECOND_SIGNAL_AFTER_S)  # still in the step or save when the last signal lands
    elif variable is not None:
        deadline = time.monotonic() + _COMES_BACK_S
        while not signal_received() and time.monotonic() < deadline:
            time.sleep(0.05)


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

    def before_eval(self, step: int) -> None:
        inject(self.fault, self.rank, "eval", step)

    def during_write(self, step: int) -> None:
        inject(self.fault, self.rank, "write", step)

    def before_export(self, step: int) -> None:
        inject(self.fault, self.rank, "export", step)
