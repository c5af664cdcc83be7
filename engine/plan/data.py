"""The data's memory: what each rank holds privately to feed its batches, and what the ranks of a
node share through the page cache.

Two kinds of bytes, because they are paid differently. Memory-mapped token files and image files
read from disk sit in the OS page cache: one copy per node, whatever its number of ranks (and
pages the kernel may drop and read again, so this is the most the data can take). Everything a
rank builds for itself is private and paid once per rank: the epoch's sample order, a blend's
indices, the batches its DataLoader workers prefetch, and data read whole into its memory (CIFAR-10's
pickles). A streamed training corpus holds only the tokens not yet cut into windows: nothing that
grows. The sizes are taken from the datasets `check_data` builds (`data_sizes`), once, and turned
into bytes per layout by `data_memory`, as the micro-batch and the workers change them.
"""

from __future__ import annotations

from dataclasses import dataclass

from data import DataBundle
from data.kinds import get_kind
from data.sharding import IN_MEMORY_ORDER_UP_TO

ORDER_BYTES = 8  # torch.randperm's int64 per sample
# torch.utils.data.DataLoader's default: each worker keeps this many batches ready.
PREFETCH_FACTOR = 2


@dataclass(frozen=True)
class DataSizes:
    """What a run's data is made of, independent of the layout: the planner weighs many layouts
    of one data set (`plan --suggest`), and reading the data once is enough for all of them."""

    samples: int | None  # training samples, the length of one epoch's order; None when streamed
    sample_bytes: int  # one training sample as DataLoader workers hold it; 0 when streamed (no workers)
    loaded: int  # bytes every rank reads whole into its own memory
    mapped: int  # bytes read through the page cache: memory-mapped token files, image files
    blend_index: int  # bytes of the index every rank builds to blend several token files


@dataclass(frozen=True)
class DataMemory:
    """The data's bytes at one layout: private to each rank, and shared once per node."""

    order: int
    blend: int
    workers: int
    loaded: int
    shared: int

    @property
    def private(self) -> int:
        return self.order + self.blend + self.workers + self.loaded


def data_sizes(bundle: DataBundle) -> DataSizes:
    """The sizes of the training and validation sets `bundle` holds, as its data kind counts them
    (data/kinds/). A streamed training corpus has no length, so no epoch order, and is read in the
    training process, without DataLoader workers."""
    footprint = get_kind(bundle.kind).footprint(bundle)
    samples = None if bundle.streamed else len(bundle.train)
    return DataSizes(samples, footprint.sample_bytes, footprint.loaded, footprint.mapped, footprint.blend_index)


def data_memory(sizes: DataSizes, micro_batch: int, num_workers: int) -> DataMemory:
    """The data's bytes for one layout. Up to `IN_MEMORY_ORDER_UP_TO` samples, the epoch's order is
    a randperm every rank keeps; beyond it the order is computed as it is read and costs nothing
    that grows. Each DataLoader worker holds its prefetched batches."""
    samples = sizes.samples or 0
    in_memory_order = sizes.samples is not None and samples <= IN_MEMORY_ORDER_UP_TO
    return DataMemory(
        order=ORDER_BYTES * samples if in_memory_order else 0,
        blend=sizes.blend_index,
        workers=num_workers * PREFETCH_FACTOR * micro_batch * sizes.sample_bytes,
        loaded=sizes.loaded,
        shared=sizes.mapped,
    )
