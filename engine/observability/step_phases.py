"""Where a step's time goes: data, forward, backward, optimizer step.

On a GPU a phase ends when its kernels end, so timing one means a host sync at each boundary,
which stalls the queue the loop otherwise keeps full. The loop therefore times only the steps it
logs (one in `log_interval`), and the others run without a single extra sync.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase, summed over the micro-batches of one step."""

    def __init__(self, device: torch.device):
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._synchronize()
        start = time.perf_counter()
        yield
        self._synchronize()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
