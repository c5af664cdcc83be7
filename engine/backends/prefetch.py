"""The next micro-batch on its way to the device while the current one trains.

A batch the loop fetched only when the step asked for it keeps the GPU waiting for the loader and
the copy. Here, as soon as the step takes its batch, the following one is fetched from the loader
and its copy queued on a side stream (from pinned memory, `data.pin_memory`, so the copy does not
wait for the host); the step's stream waits for that copy only when it takes the batch. On the CPU
there is nothing to overlap: batches move as the loader yields them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.backends.base import Batch, to_device


class DevicePrefetcher(Iterator[dict[str, torch.Tensor]]):
    """Yields the loader's batches on `device`, floating inputs in `dtype`, one fetched ahead on a GPU.

    Fetching ahead moves nothing in the data order: a resumed run finds its place from the step
    count (data/loader.py), not from what the loader has handed out."""

    def __init__(self, batches: Iterator[Batch], device: torch.device, dtype: torch.dtype):
        self._batches, self._device, self._dtype = batches, device, dtype
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._upcoming: dict[str, torch.Tensor] | None = None

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._stream is None:
            return to_device(next(self._batches), self._device, self._dtype)
        current = self._upcoming if self._upcoming is not None else self._copy()
        torch.cuda.current_stream(self._device).wait_stream(self._stream)
        for tensor in current.values():
            # The side stream's memory pool must not reuse these before the step is done with them.
            tensor.record_stream(torch.cuda.current_stream(self._device))
        try:
            self._upcoming = self._copy()
        except StopIteration:
            self._upcoming = None  # the next call ends the iteration
        return current

    def _copy(self) -> dict[str, torch.Tensor]:
        with torch.cuda.stream(self._stream):
            return to_device(next(self._batches), self._device, self._dtype)
