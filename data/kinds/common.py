"""What every data kind's module builds on (data/kinds/): the request a build answers, what the
planner counts of the datasets, and the answer of a kind with nothing to prepare ahead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.utils.data import Dataset


class NothingToPrepare(Exception):
    """`prepare_ahead` of a kind whose data is read as it is (or streamed): the reason why."""


@dataclass(frozen=True)
class BuildRequest:
    """What the model asks of the data: `samples` is its family's ("tokens" or "images"),
    `seq_len` cuts token samples, and `vocab_size` and `num_classes` (from the model config) size
    synthetic data only; real data reports its own."""

    samples: str
    seed: int
    seq_len: int | None
    vocab_size: int | None
    num_classes: int | None


@dataclass(frozen=True)
class Footprint:
    """What the planner counts of a bundle's datasets (engine/plan/data.py): one training sample as
    DataLoader workers hold it (the largest a collated micro-batch can give, per sample), bytes each
    rank reads whole into its own memory, bytes read through the page cache (memory-mapped token
    files, image files) and the index each rank builds to blend several token files."""

    sample_bytes: int
    loaded: int = 0
    mapped: int = 0
    blend_index: int = 0


def first_sample_bytes(dataset: Dataset) -> int:
    """The bytes of the dataset's first sample: every sample of a fixed-shape dataset."""
    return sum(tensor.nbytes for tensor in dataset[0].values())
