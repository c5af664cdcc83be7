"""The data benchmark's preparation part: `prepare_text` into an empty cache, timed beside a bare
baseline doing the same work, the two alternating so that drift in a shared machine's load reaches
both (bench/data.py's docstring says which baseline each tokenizer gets, and why)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.data_labels import size_label
from data.tokens.corpus import open_corpus
from data.tokens.encode import piece_batches
from data.tokens.prepare import prepare_text

CACHE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class Preparation:
    """One tokenizer on one corpus: the engine's and the baseline's best seconds, and the tokens
    (checked equal on both sides)."""

    tokenizer: str
    size_mb: float
    engine_s: float
    baseline_s: float
    tokens: int


def time_preparation(name: str, spec: str, corpus: Path, size_mb: float, cache: Path, repeats: int) -> Preparation:
    """The best of `repeats` preparations of `corpus` into an empty `cache`, each after one run of the
    baseline."""
    baseline = (lambda: bare_read(corpus)) if spec in ("byte", "char") else tokenizer_alone(spec, corpus)
    engine_s = baseline_s = float("inf")
    for _ in range(repeats):
        seconds, baseline_tokens = _timed(baseline)
        baseline_s = min(baseline_s, seconds)
        shutil.rmtree(cache, ignore_errors=True)
        seconds, engine_tokens = _timed(lambda: prepare_tokens(corpus, spec, cache))
        engine_s = min(engine_s, seconds)
    shutil.rmtree(cache)
    if engine_tokens != baseline_tokens:
        raise RuntimeError(
            f"prepare {name}, {size_label(size_mb)}: the engine wrote {engine_tokens:,} tokens where its baseline "
            f"counted {baseline_tokens:,}; they are not doing the same work"
        )
    speeds = f"{size_mb / engine_s:,.1f} MB/s, baseline {size_mb / baseline_s:,.1f} MB/s"
    print(f"  prepare {name}, {size_label(size_mb)}: {speeds}", flush=True)
    return Preparation(name, size_mb, engine_s, baseline_s, engine_tokens)


def prepare_tokens(corpus: Path, spec: str, cache: Path) -> int:
    """What `python -m engine prepare-data` does for a .txt corpus; returns the tokens written."""
    prepared, _ = prepare_text(
        [corpus], tokenizer=spec, text_field="text", cache_dir=cache, timeout_s=CACHE_TIMEOUT_S, announce=_quiet
    )
    return prepared.meta["splits"]["train"]["tokens"]


def bare_read(corpus: Path) -> int:
    return len(np.frombuffer(corpus.read_bytes(), dtype=np.uint8))


def tokenizer_alone(tokenizer_dir: str, corpus: Path) -> Callable[[], int]:
    """The tokenizer's own batched call on the engine's batches of pieces, read and cut here ahead of
    time so that only the encoding is timed; it counts the tokens without copying them out of Rust."""
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).backend_tokenizer
    documents = open_corpus([corpus], "text", corpus.parent / "scratch").splits["train"]()
    batches = [batch.pieces for batch in piece_batches(documents, cut=True)]

    def encode() -> int:
        return sum(
            len(encoding)
            for pieces in batches
            for encoding in backend.encode_batch_fast(pieces, add_special_tokens=False)
        )

    return encode


def _timed(work: Callable[[], int]) -> tuple[float, int]:
    started = time.perf_counter()
    value = work()
    return time.perf_counter() - started, value


def _quiet(message: str) -> None:
    """prepare_text's announcements: the benchmark prints its own line per measurement."""
