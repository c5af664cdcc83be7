"""What a family declares of its tensor-parallel form (parallelism/tensor.py applies it): plain data,
so that the config checks read which fields the degree must divide without importing torch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which modules of a family's model split how, by glob pattern over module names, and the
    attributes of the attention modules that count heads and widths per rank.

    `head` is the language-model head: tied to `vocab_embedding` (the same weight) it becomes the
    sharded embedding's output projection, untied it is split by vocabulary rows on its own.
    `divisible` names the architecture fields the degree must divide (each with what it counts, for
    the message that refuses a degree before launch): heads, key/value heads, MLP width.
    """

    column: Mapping[str, int]  # pattern -> chunks
    row: tuple[str, ...]
    vocab_embedding: str
    head: str
    per_rank_attributes: Mapping[str, tuple[str, ...]]  # pattern -> attributes divided by the degree
    divisible: Mapping[str, str]  # architecture field -> what it counts
