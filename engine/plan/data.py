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

import os
from dataclasses import dataclass, field

import datasets
import numpy as np
from torch.utils.data import Dataset

from data import DataBundle
from data.image import FolderImages, ImageDataset, TensorImages
from data.sharding import IN_MEMORY_ORDER_UP_TO
from data.streaming import StreamedCorpus
from data.synthetic import SyntheticImages, SyntheticTokens
from data.text import PackedTokens
from data.tokens.blend import BlendedTokens

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
    """The sizes of the training and validation sets `bundle` holds. A streamed training corpus has
    no length, so no epoch order, and is read in the training process, without DataLoader workers."""
    streamed = isinstance(bundle.train, StreamedCorpus)
    sample_bytes = 0 if streamed else sum(tensor.nbytes for tensor in bundle.train[0].values())
    held = _Held()
    for dataset in (bundle.train, bundle.validation):
        held.add(dataset)
    for table in held.tables.values():
        # An imagefolder's table (paths and labels, in memory) and its image files, once however
        # many splits index into it.
        held.loaded += table.data.nbytes
        held.mapped += _image_file_bytes(table)
    samples = None if streamed else len(bundle.train)
    return DataSizes(samples, sample_bytes, held.loaded, held.mapped, held.blend_index)


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


@dataclass
class _Held:
    """The bytes behind the datasets added so far. Imagefolder tables are collected, not summed: the
    training and validation splits of one folder share one."""

    loaded: int = 0
    mapped: int = 0
    blend_index: int = 0
    tables: dict[int, datasets.Dataset] = field(default_factory=dict)

    def add(self, dataset: Dataset) -> None:
        if isinstance(dataset, PackedTokens):
            tokens = dataset.tokens
            if isinstance(tokens, np.memmap):
                self.mapped += tokens.nbytes
            else:
                self.loaded += tokens.nbytes
        elif isinstance(dataset, BlendedTokens):
            # Megatron's two blending indices, each rank's own: the source and the sample in it.
            self.blend_index += dataset.dataset_index.nbytes + dataset.dataset_sample_index.nbytes
            for source in dataset.sources:
                self.add(source)
        elif isinstance(dataset, ImageDataset) and isinstance(dataset.source, TensorImages):
            self.loaded += dataset.source.images.nbytes + dataset.source.labels.nbytes
        elif isinstance(dataset, ImageDataset) and isinstance(dataset.source, FolderImages):
            self.tables[id(dataset.source.dataset)] = dataset.source.dataset
        elif not isinstance(dataset, SyntheticTokens | SyntheticImages | StreamedCorpus):  # nothing that grows
            raise TypeError(
                f"the planner does not know how a {type(dataset).__name__} holds its samples; teach engine/plan/data.py"
            )


def _image_file_bytes(table: datasets.Dataset) -> int:
    """The files an imagefolder table points at: decoded one at a time, read through the page cache.
    An image whose bytes the table holds itself is already in `table.data.nbytes`."""
    images = table.data.column("image").combine_chunks()
    on_disk = images.filter(images.field("bytes").is_null())
    return sum(os.path.getsize(path) for path in on_disk.field("path").to_pylist())
