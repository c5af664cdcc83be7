"""data.type "text": raw text (.txt, .json, .jsonl, .parquet, a save_to_disk folder; null: the
embedded corpus) tokenized once into the token cache and cut into windows, or streamed."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from data.bundle import DataBundle
from data.kinds.common import BuildRequest, Footprint, NothingToPrepare, first_sample_bytes
from data.streaming import StreamedCorpus, is_hub_id
from data.text import PackedTokens, load_text_dataset, text_paths
from data.tokens.prepare import prepare_text

GIVES = ("tokens",)
PATH_NEEDED = None  # null: the embedded default corpus
READS_TOKENIZER = True
MASKS_LABELS = False
SCHEMA = {
    "streaming": {
        "type": "boolean",
        "description": "text: read the corpus lazily with Hugging Face datasets' streaming, split over the "
        "data-parallel ranks, tokenizing and packing as it goes; each checkpoint saves every rank's position. For "
        "corpora that do not fit on local disk. Needs data.validation_path.",
        "default": False,
    },
    "text_field": {
        "type": "string",
        "description": "text: the column holding the text in json/parquet data.",
        "default": "text",
    },
}


def path_exists(key: str, path: str, data: Mapping[str, Any]) -> bool:
    """A streamed corpus may be a Hugging Face Hub dataset id."""
    return os.path.exists(path) or (key == "path" and data["streaming"] and is_hub_id(path))


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    if not data["streaming"]:
        return
    if data["tokenizer"] == "char":
        yield (
            "data.tokenizer",
            '"char" builds its vocabulary from the whole corpus, which streaming never holds; use "byte" or a '
            "Hugging Face tokenizer directory",
        )
    if data["validation_path"] is None:
        yield (
            "data.validation_path",
            "streaming needs held-out text to evaluate on (a stream has no end to hold out); name a file or files",
        )
    if data["num_workers"]:
        yield (
            "data.num_workers",
            "streaming reads in the training process, so that each checkpoint records exactly what was read; set 0",
        )


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    if data.get("streaming"):
        return _streaming_bundle(data, request.seq_len)
    text = load_text_dataset(
        data["path"],
        seq_len=request.seq_len,
        tokenizer=data["tokenizer"],
        text_field=data["text_field"],
        validation_fraction=data["validation_fraction"],
        stride=data.get("stride", request.seq_len),
        cache_dir=cache_dir(data),
        cache_timeout_s=data.get("cache_timeout_s", 3600),
    )
    return DataBundle("text", text.train, text.validation, text.tokenizer, text.tokenizer.vocab_size, None)


def _streaming_bundle(data: Mapping[str, Any], seq_len: int) -> DataBundle:
    """Training text streamed (data/streaming.py); the held-out text, which an evaluation reads again
    and again, prepared into the token cache like any corpus."""
    validation = load_text_dataset(
        data["validation_path"],
        seq_len=seq_len,
        tokenizer=data["tokenizer"],
        text_field=data["text_field"],
        cache_dir=cache_dir(data),
        cache_timeout_s=data.get("cache_timeout_s", 3600),
        held_out_only=True,
    )
    train = StreamedCorpus(data["path"], data["text_field"], validation.tokenizer, seq_len)
    tokenizer = validation.tokenizer
    return DataBundle("text", train, validation.validation, tokenizer, tokenizer.vocab_size, None, streamed=True)


def cache_dir(data: Mapping[str, Any]) -> str | None:
    """The configured cache folder; None (the default one) where the section was not resolved."""
    return None if data.get("cache_dir", "auto") == "auto" else data["cache_dir"]


def footprint(bundle: DataBundle) -> Footprint:
    """A streamed corpus holds only the tokens not yet cut into windows: nothing that grows."""
    datasets = [bundle.validation] if bundle.streamed else [bundle.train, bundle.validation]
    loaded, mapped = token_bytes(datasets)
    return Footprint(0 if bundle.streamed else first_sample_bytes(bundle.train), loaded, mapped)


def token_bytes(datasets: list[PackedTokens]) -> tuple[int, int]:
    """(bytes in memory, bytes memory-mapped) of the streams under windows of tokens."""
    loaded = mapped = 0
    for dataset in datasets:
        if isinstance(dataset.tokens, np.memmap):
            mapped += dataset.tokens.nbytes
        else:
            loaded += dataset.tokens.nbytes
    return loaded, mapped


def prepare_ahead(data: Mapping[str, Any]) -> str:
    if data["streaming"]:
        raise NothingToPrepare("streams its text as it trains")
    prepared, tokenizer = prepare_text(
        text_paths(data["path"]),
        tokenizer=data["tokenizer"],
        text_field=data["text_field"],
        cache_dir=Path(data["cache_dir"]),
        timeout_s=data["cache_timeout_s"],
    )
    return f"{prepared.describe()}; vocabulary {tokenizer.vocab_size}"
