"""The batch triple: train_batch_size = micro-batch x accumulation x data-parallel size.

Solved here and only here, the way DeepSpeed solves it (any one of the three may be missing),
so that validation and the running engine can never disagree about a derived value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchTriple:
    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


class BatchError(ValueError):
    """The triple cannot be satisfied; `path` is the key the user should change."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


# The micro-batch an all-"auto" batch takes: HF TrainingArguments' per_device_train_batch_size default.
DEFAULT_MICRO_BATCH = 8


def solve_batch_triple(
    train_batch_size: int | None,
    micro_batch_size: int | None,
    accumulation: int | None,
    dp_size: int,
    auto: bool = False,
) -> BatchTriple:
    """`auto`: the batch was written as "auto" (HF's and accelerate's templates), so with neither
    size known the micro-batch is DEFAULT_MICRO_BATCH, and accumulation 1 unless given."""
    train, micro, accum = train_batch_size, micro_batch_size, accumulation
    if train is None and micro is None and auto:
        micro = DEFAULT_MICRO_BATCH
    if train is None and micro is None:
        raise BatchError(
            "train_batch_size",
            "set train_batch_size or train_micro_batch_size_per_gpu (neither is given, so the batch is unknown)",
        )
    if train is not None and micro is not None and accum is not None:
        if train != micro * accum * dp_size:
            raise BatchError(
                "train_batch_size",
                f"{train} != train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {accum} x "
                f"data-parallel size {dp_size} = {micro * accum * dp_size}; fix one of them or drop "
                "train_batch_size to have it computed",
            )
        return BatchTriple(train, micro, accum)
    if train is None:
        accum = accum or 1
        return BatchTriple(micro * accum * dp_size, micro, accum)
    if micro is None:
        accum = accum or 1
        if train % (accum * dp_size):
            raise BatchError(
                "train_batch_size",
                f"{train} is not divisible by gradient_accumulation_steps {accum} x data-parallel size {dp_size}; "
                f"use a multiple of {accum * dp_size}",
            )
        return BatchTriple(train, train // (accum * dp_size), accum)
    if train % (micro * dp_size):
        raise BatchError(
            "train_batch_size",
            f"{train} is not divisible by train_micro_batch_size_per_gpu {micro} x data-parallel size {dp_size}; "
            f"use a multiple of {micro * dp_size}",
        )
    return BatchTriple(train, micro, train // (micro * dp_size))


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def solve_document_batch(document: dict, dp_size: int) -> BatchTriple:
    """The triple a config's batch keys describe: absent and "auto" are both unknown, and "auto"
    anywhere in the triple lets an unknown batch take its default."""
    values = [document.get(key, "auto") for key in BATCH_KEYS]
    known = [None if value == "auto" else value for value in values]
    written_auto = any(document.get(key) == "auto" for key in BATCH_KEYS)
    return solve_batch_triple(*known, dp_size, auto=written_auto)
