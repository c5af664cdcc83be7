"""Where a step's time goes: data, forward, backward, optimizer step.

The loop times only the steps it logs (one in `log_interval`); the others run untimed. On a GPU a
phase's time is its kernels' time, measured with CUDA events recorded into the stream around it and
read once the step is over, so timing a step does not stall the queue the host keeps full. On the
CPU a phase's host time is its time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase, summed over the micro-batches of one step."""

    def __init__(self, device: torch.device):
        self._events = device.type == "cuda"
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
            return
        start_s = time.perf_counter()
        yield
        self._add(name, time.perf_counter() - start_s)

    @property
    def seconds(self) -> dict[str, float]:
        """Waits for the timed phases' last kernels: read it at a log point, which waits anyway."""
        for name, start, end in self._pending:
            end.synchronize()
            self._add(name, start.elapsed_time(end) / 1e3)
        self._pending.clear()
        return self._seconds

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
