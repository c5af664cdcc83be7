"""The prepared-corpus format: flat token files that every rank memory-maps, and the metadata
that says what they hold.

A prepared corpus is one folder:

    meta.json                what follows, written last: its presence marks the folder complete
    train.bin                the training split's tokens, end to end, in `dtype` (nanoGPT's layout)
    train.docs.npy           int64 start offset of every document in train.bin
    validation.bin/.docs.npy only where the source has its own validation split
    train.mask.bin           conversations only (meta.json's "loss_mask"): one uint8 per token, 1 where
                             the token is a target (data/chat/)

`train.bin` is exactly what nanoGPT's prepare.py writes (a headerless array of ids), so the file
is also usable by nanoGPT and by `data.type: "tokens"`. The folder is written under a staging
name and renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "dsengine-tokens"
VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "validation")


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id below `vocab_size`: uint8 for bytes, uint16 for
    GPT-2's 50257 tokens (half of int32's disk and page cache), uint32 beyond."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit in 32 bits")


class SplitWriter:
    """Appends one split's tokens to its .bin in blocks, remembering where each document starts."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype) -> None:
        self.split, self.dtype = split, dtype
        self.path = folder / f"{split}.bin"
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by finish()
        self._starts: list[int] = []
        self.tokens = 0

    @property
    def documents(self) -> int:
        return len(self._starts)

    def write(self, ids: np.ndarray, document_starts: Sequence[int] = ()) -> None:
        """Append `ids`; `document_starts` are offsets into `ids` where documents begin."""
        self._starts.extend(self.tokens + start for start in document_starts)
        block = np.ascontiguousarray(ids, dtype=self.dtype)
        self._file.write(block.data)
        self.tokens += len(block)

    def finish(self) -> dict[str, int]:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        np.save(self.path.with_suffix(".docs.npy"), np.asarray(self._starts, dtype=np.int64))
        return {"tokens": self.tokens, "documents": len(self._starts)}

    def abandon(self) -> None:
        self._file.close()


def publish(staging: Path, target: Path, meta: Mapping[str, Any]) -> None:
    """Write `meta.json` into the finished `staging` folder and rename it to `target`.

    A damaged `target` left by an earlier crash or a cut-short copy is moved aside first; a
    complete one (another process published the same corpus meanwhile) is kept and the staging
    folder dropped."""
    meta_path = staging / META_FILE
    meta_path.write_text(json.dumps({"format": FORMAT, "version": VERSION, **meta}, indent=1) + "\n")
    with open(meta_path) as handle:
        os.fsync(handle.fileno())
    if target.exists():
        if damage(target) is None:
            shutil.rmtree(staging)
            return
        shutil.rmtree(target)
    os.rename(staging, target)


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared folder, its token files memory-mapped: nothing is read until a window is."""

    folder: Path
    meta: dict[str, Any]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def splits(self) -> list[str]:
        return [split for split in SPLITS if split in self.meta["splits"]]

    def tokens(self, split: str) -> np.ndarray:
        count = self.meta["splits"][split]["tokens"]
        if count == 0:
            return np.empty(0, dtype=self.dtype)
        return np.memmap(self.folder / f"{split}.bin", dtype=self.dtype, mode="r", shape=(count,))

    def describe(self) -> str:
        counts = ", ".join(
            f"{split} {self.meta['splits'][split]['tokens']:,} tokens in {self.meta['splits'][split]['documents']:,} "
            "documents"
            for split in self.splits
        )
        return f"{self.folder}: {counts} ({self.dtype.name}, nanoGPT's flat layout: {self.splits[0]}.bin)"

    def document_starts(self, split: str) -> np.ndarray:
        return np.load(self.folder / f"{split}.docs.npy", mmap_mode="r")

    def loss_mask(self, split: str) -> np.ndarray:
        """Conversations: 1 where the token at that position of `tokens(split)` is a target."""
        count = self.meta["splits"][split]["tokens"]
        if count == 0:
            return np.empty(0, dtype=np.uint8)
        return np.memmap(self.folder / f"{split}.mask.bin", dtype=np.uint8, mode="r", shape=(count,))


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((folder / META_FILE).read_text())


def damage(folder: Path) -> str | None:
    """What is wrong with a prepared folder (None when it is whole): a missing or unreadable meta.json,
    another format version, or a token or document file whose size disagrees with it. Sizes only:
    cheap enough for every launch, and what a crash or a cut-short copy leaves behind."""
    try:
        meta = read_meta(folder)
    except (OSError, ValueError) as error:
        return f"{META_FILE} is missing or unreadable ({type(error).__name__})"
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return f"{META_FILE} is not {FORMAT} version {VERSION}"
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, counts in meta["splits"].items():
        path = folder / f"{split}.bin"
        expected = counts["tokens"] * itemsize
        actual = path.stat().st_size if path.is_file() else None
        if actual != expected:
            return f"{path.name} holds {actual} bytes where {META_FILE} promises {expected}"
        mask = folder / f"{split}.mask.bin"
        if meta.get("loss_mask") and (mask.stat().st_size if mask.is_file() else None) != counts["tokens"]:
            return f"{mask.name} does not hold the one byte per token {META_FILE} promises"
        try:
            starts = np.load(folder / f"{split}.docs.npy", mmap_mode="r")
        except (OSError, ValueError):
            return f"{split}.docs.npy is missing or damaged"
        if len(starts) != counts["documents"]:
            return f"{split}.docs.npy lists {len(starts)} documents where {META_FILE} promises {counts['documents']}"
    return None


def open_prepared(folder: Path) -> PreparedCorpus:
    problem = damage(folder)
    if problem is not None:
        raise ValueError(f"prepared corpus {folder} is damaged: {problem}")
    return PreparedCorpus(folder, read_meta(folder))


def source_record(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Each source file with its size and modification time: what the cache key and the metadata
    record, so that an edited, replaced or touched file rebuilds the tokens."""
    records = []
    for path in paths:
        stat = path.stat()
        records.append({"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return records
