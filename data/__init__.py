"""Datasets and data-parallel loaders built from the `data` section of a run config."""

from collections.abc import Mapping
from typing import Any

from data.bundle import SAMPLES, DataBundle
from data.corpus import DEFAULT_CORPUS
from data.kinds import BuildRequest, get_kind
from data.sharding import batches_per_epoch, global_batch_indices, micro_batch_indices
from data.tokenizers import Tokenizer, load_saved_tokenizer

__all__ = [
    "DEFAULT_CORPUS",
    "SAMPLES",
    "DataBundle",
    "Tokenizer",
    "batches_per_epoch",
    "build_datasets",
    "global_batch_indices",
    "load_saved_tokenizer",
    "micro_batch_indices",
]


def build_datasets(
    data_cfg: Mapping[str, Any],
    *,
    samples: str,
    seed: int,
    seq_len: int | None,
    vocab_size: int | None,
    num_classes: int | None,
) -> DataBundle:
    """Build the training and validation datasets a validated `data` config section describes, as
    its kind (data/kinds/) builds them.

    `samples` is what the model trains on (its family's `samples`): "tokens" (samples of `seq_len`
    tokens and their next-token labels) or "images". `vocab_size` and `num_classes` come from the
    model config and size synthetic data only; real data reports its own.
    """
    kind = get_kind(data_cfg["type"])
    if samples not in SAMPLES:
        raise ValueError(f"samples {samples!r} are unknown; expected one of {', '.join(SAMPLES)}")
    if samples not in kind.gives:
        gives = " or ".join(kind.gives)
        raise ValueError(f"data.type {kind.name!r} gives {gives}, not the {samples} the model trains on")
    if samples == "tokens" and seq_len is None:
        raise ValueError("a model trained on tokens needs seq_len to cut token samples")
    return kind.build(data_cfg, BuildRequest(samples, seed, seq_len, vocab_size, num_classes))
