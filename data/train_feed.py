"""A rank's training micro-batches, however its data is read: a dataset's, drawn by the sampler's
arithmetic from the step count, or a stream's, read in order with its place kept in each checkpoint.
The trainer asks for the feed its data gives and never branches on which it is."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import Tensor
from torch.utils.data import Dataset

from data.bundle import DataBundle
from data.loader import make_train_loader
from data.streaming import StreamedWindows, stream_micro_batches

Batch = dict[str, Tensor]
# What carries the loader's batches to the device (engine/backends/prefetch.py), one ahead on a GPU.
OnDevice = Callable[[Iterator[Batch]], Iterator[Batch]]


@dataclass(frozen=True)
class BatchShape:
    """The micro-batch arithmetic of one data-parallel rank, and how its loader reads."""

    micro_batch_size: int
    grad_accum: int
    dp_rank: int
    dp_size: int
    seed: int
    num_workers: int
    pin_memory: bool


class SampledFeed:
    """A dataset's micro-batches: where a resumed run starts follows from its step alone (data/loader.py),
    so nothing of the data is saved with a checkpoint."""

    position: None = None

    def __init__(self, dataset: Dataset, shape: BatchShape) -> None:
        self._dataset, self._shape = dataset, shape

    def micro_batches(self, start_step: int, on_device: OnDevice) -> Iterator[Batch]:
        shape = self._shape
        loader = make_train_loader(
            self._dataset,
            micro_batch_size=shape.micro_batch_size,
            grad_accum=shape.grad_accum,
            dp_rank=shape.dp_rank,
            dp_size=shape.dp_size,
            seed=shape.seed,
            start_step=start_step,
            num_workers=shape.num_workers,
            pin_memory=shape.pin_memory,
        )
        return on_device(loader)


class StreamedFeed:
    """A stream's micro-batches: `position`, the windows this rank reads, is what a checkpoint saves and
    a resume restores; the step count says nothing of it."""

    def __init__(self, position: StreamedWindows, micro_batch_size: int) -> None:
        self.position, self._micro_batch_size = position, micro_batch_size

    def micro_batches(self, start_step: int, on_device: OnDevice) -> Iterator[Batch]:
        # Not through `on_device`: fetching a batch ahead would move the place the next checkpoint records,
        # so a stream's batches move only when the step takes them.
        return stream_micro_batches(self.position, self._micro_batch_size)


def train_feed(bundle: DataBundle, shape: BatchShape) -> SampledFeed | StreamedFeed:
    """The feed of `bundle`'s training data on this rank."""
    if bundle.streamed:
        return StreamedFeed(bundle.train.windows(shape.dp_rank, shape.dp_size), shape.micro_batch_size)
    return SampledFeed(bundle.train, shape)
