"""Stopping a run early with a checkpoint: on a scheduler's signal, or before a wall-clock limit.

A scheduler preempts a job with a signal (SIGTERM; SLURM's `--signal` sends SIGUSR1) and kills it a
grace period later. Megatron-LM checks its signal flag only at iteration boundaries, from the main
thread, so a signal that lands during evaluation or a save waits for it, and a second one cannot
cut a stuck save short. Here the signal wakes a watcher thread (through Python's wakeup fd, which
the C-level handler writes even while the main thread is inside a collective): the first signal
is recorded and starts the grace timer, a second one ends the process at once. The loop asks
`StopRequests.reason_to_stop` at each step boundary: one small all-reduce on the host (gloo), so
every rank agrees to save at the same step whichever rank was signalled, and no device is read.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import psutil
import torch
import torch.distributed as dist

from engine.parallel.process_group import host_group

# Launchers pass a signal to a rank and to its supervisor, which passes it on again: copies of one
# signal arrive within this window and count once.
_SAME_SIGNAL_WINDOW_S = 2.0
# What an unmeasured save is assumed to write per second: a conservative shared file system.
ASSUMED_SAVE_BYTES_PER_S = 5e8
# Checkpointed bytes per parameter: fp32 weights, two fp32 Adam moments, a 16-bit copy.
CHECKPOINT_BYTES_PER_PARAMETER = 14

Item = TypeVar("Item")


def estimated_save_s(parameters: int) -> float:
    """A save's duration before one has been measured: every parameter's checkpointed bytes at
    ASSUMED_SAVE_BYTES_PER_S."""
    return parameters * CHECKPOINT_BYTES_PER_PARAMETER / ASSUMED_SAVE_BYTES_PER_S


def format_seconds(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class _Received:
    signum: int = 0
    at: float = 0.0


_first_in_process = _Received()  # signals are the process's, whichever StopRequests caught them


def signal_received() -> int:
    """The first stop signal this process caught (0: none yet)."""
    return _first_in_process.signum


class StopRequests:
    """This rank's requests to stop early, and the collective decision to act on them.

    `signals` are the numbers that ask for a save (none: signals keep their default action);
    `grace_s` the most a save may take after the first signal; `max_wall_s` the wall-clock limit,
    counted from this process's start, or None."""

    def __init__(self, signals: list[int], grace_s: float, max_wall_s: float | None) -> None:
        self.signals, self.grace_s, self.max_wall_s = signals, grace_s, max_wall_s
        self.started = psutil.Process().create_time()
        self._received = _Received()
        self._lock = threading.Lock()
        self._group = None
        self.cut_short = False  # the last `until_signalled` stopped early

    def install(self) -> StopRequests:
        """Catch the signals; collective where a process group is up (the ranks' host-side group)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            self._group = host_group()
        if not self.signals:
            return self
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        for signum in self.signals:
            signal.signal(signum, lambda signum, frame: None)  # the C handler writes the wakeup fd
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_end,), name="stop-requests", daemon=True).start()
        return self

    def _watch(self, read_end: int) -> None:
        while True:
            for signum in os.read(read_end, 64):
                if signum in self.signals:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        now = time.monotonic()
        with self._lock:
            first = self._received.signum == 0
            if not first and now - self._received.at < _SAME_SIGNAL_WINDOW_S:
                return
            if not first:
                print(f"second signal ({signal.Signals(signum).name}): ending without a save", flush=True)
                os._exit(128 + signum)
            self._received = _Received(signum, now)
            if _first_in_process.signum == 0:
                _first_in_process.signum, _first_in_process.at = signum, now
        name = signal.Signals(signum).name
        print(f"{name} received: saving at the next step boundary (at most {self.grace_s:g} s)", flush=True)
        timer = threading.Timer(self.grace_s, self._grace_over, args=(signum,))
        timer.daemon = True
        timer.start()

    def _grace_over(self, signum: int) -> None:
        print(f"no save within trainer.signal_grace_s ({self.grace_s:g} s): ending without one", flush=True)
        os._exit(128 + signum)

    def signalled(self) -> bool:
        """Whether this rank was signalled (no collective: evaluation asks between its batches)."""
        return self._received.signum != 0

    def signal_name(self) -> str | None:
        """The signal this rank caught first, by name (None: none)."""
        return signal.Signals(self._received.signum).name if self._received.signum else None

    def until_signalled(self, items: Iterable[Item]) -> Iterator[Item]:
        """`items` until any rank is signalled, agreed before each item (collective): every rank stops
        at the same one, so per-item collectives (ZeRO-3's gathers, pipeline stages) stay paired."""
        self.cut_short = False
        for item in items:
            if self._any(self._received.signum):
                self.cut_short = True
                return
            yield item

    def _any(self, value: int) -> int:
        flag = torch.tensor([value], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag[0])

    def elapsed_s(self) -> float:
        return time.time() - self.started

    def reason_to_stop(self, step_s: float, last_save_s: float | None, parameters: int) -> str | None:
        """Collective at a step boundary: why every rank stops now, or None. The wall-clock limit
        stops a run once what is left is less than the last save (or an estimate for `parameters`,
        before one) plus one more step."""
        save_s = last_save_s if last_save_s is not None else estimated_save_s(parameters)
        wall = self.max_wall_s is not None and self.max_wall_s - self.elapsed_s() < save_s + step_s
        flags = torch.tensor([self._received.signum, int(wall)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
        signum, wall = int(flags[0]), bool(flags[1])
        if signum:
            return f"{signal.Signals(signum).name} received"
        if wall:
            left = self.max_wall_s - self.elapsed_s()
            return (
                f"trainer.max_wall_time {format_seconds(self.max_wall_s)}: stopping with {format_seconds(left)} left "
                f"(a save takes {save_s:.1f} s, a step {step_s:.1f} s)"
            )
        return None
