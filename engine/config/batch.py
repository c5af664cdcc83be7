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


def solve_batch_triple(
    train_batch_size: int | None, micro_batch_size: int | None, accumulation: int | None, dp_size: int
) -> BatchTriple:
    train, micro, accum = train_batch_size, micro_batch_size, accumulation
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
