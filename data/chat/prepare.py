"""Conversations tokenized once into the token cache, as text corpora are (data/tokens/prepare.py).

The folder holds what a prepared text corpus holds (each split's ids end to end in `<split>.bin`,
where each conversation starts in `<split>.docs.npy`) and beside it `<split>.mask.bin`, one byte per
token, 1 where the token is a target. Every rank memory-maps the three, so a million conversations
cost what a gigabyte of text costs. Its key adds to a text corpus's (the files' paths, sizes and
modification times, the tokenizer's whole definition) the kind of record, the chat template and
which tokens train; meta.json records which records of which file each split holds, so a refusal
later names the file and the record.
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from data.chat.records import ROWS_PER_BATCH, ToConversation, conversations, open_records, record_files
from data.chat.render import ChatFormat
from data.tokens.cache import corpus_key, prepared_corpus
from data.tokens.files import PreparedCorpus, SplitWriter, publish, smallest_dtype, source_record


def prepare_conversations(
    paths: Sequence[Path],
    *,
    kind: str,
    to_conversation: ToConversation,
    chat: ChatFormat,
    cache_dir: Path,
    timeout_s: float,
    announce: Callable[[str], None] = print,
) -> PreparedCorpus:
    """The records at `paths` (of data.type `kind`, read by `to_conversation`) as ids and loss mask,
    from the cache, built there first if no process has built it. A bad record is one ValueError
    naming its file and number, raised before anything is published."""
    files = record_files(paths)
    recipe = {"kind": kind, **chat.recipe}
    folder = Path(cache_dir) / corpus_key(source_record(files), chat.tokenizer.identity, kind, recipe)

    def build(staging: Path) -> None:
        names = ", ".join(map(str, paths))
        announce(f"data: tokenizing the conversations of {names} into {folder} (once; later runs reuse it)")
        staging.mkdir(parents=True)
        try:
            started = time.perf_counter()
            splits = {}
            for split, sources in open_records(paths, staging / "scratch").items():
                writer = _ConversationWriter(staging, split, smallest_dtype(chat.tokenizer.vocab_size))
                try:
                    for source in sources:
                        records = conversations(source, to_conversation)
                        while batch := list(itertools.islice(records, ROWS_PER_BATCH)):
                            for ids, mask in chat.tokenize(batch):
                                writer.write(ids, mask)
                        writer.end_file(source.label)
                except BaseException:
                    writer.abandon()
                    raise
                splits[split] = writer.finish()
            shutil.rmtree(staging / "scratch", ignore_errors=True)
            publish(staging, folder, _meta(chat, kind, files, splits))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        counts = splits.values()
        announce(
            f"data: tokenized {sum(c['documents'] for c in counts):,} conversations into "
            f"{sum(c['tokens'] for c in counts):,} tokens ({sum(c['targets'] for c in counts):,} targets) in "
            f"{time.perf_counter() - started:.1f} s"
        )

    prepared = prepared_corpus(folder, build, timeout_s=timeout_s, announce=announce)
    if prepared.meta["tokenizer"]["fingerprint"] != chat.tokenizer.fingerprint:
        raise ValueError(
            f"data.tokenizer: the token cache {folder} was written by another tokenizer; delete the folder to "
            "rebuild it"
        )
    return prepared


class _ConversationWriter:
    """One split's ids (SplitWriter: .bin and .docs.npy), its loss mask, and its files' record counts."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype) -> None:
        self.tokens = SplitWriter(folder, split, dtype)
        self.mask_path = folder / f"{split}.mask.bin"
        self._mask = open(self.mask_path, "wb")  # noqa: SIM115 - closed by finish() or abandon()
        self.files: list[list[Any]] = []
        self.targets = 0
        self._file_start = 0

    def write(self, ids: np.ndarray, mask: np.ndarray) -> None:
        self.tokens.write(ids, [0])
        self._mask.write(np.ascontiguousarray(mask, dtype=np.uint8).data)
        self.targets += int(mask[1:].sum())  # the first token of a conversation is never predicted

    def end_file(self, label: str) -> None:
        self.files.append([label, self.tokens.documents - self._file_start])
        self._file_start = self.tokens.documents

    def finish(self) -> dict[str, Any]:
        self._mask.flush()
        os.fsync(self._mask.fileno())
        self._mask.close()
        return {**self.tokens.finish(), "targets": self.targets, "files": self.files}

    def abandon(self) -> None:
        self.tokens.abandon()
        self._mask.close()


def _meta(chat: ChatFormat, kind: str, files: list[Path], splits: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "dtype": smallest_dtype(chat.tokenizer.vocab_size).name,
        "vocab_size": chat.tokenizer.vocab_size,
        "tokenizer": {"identity": chat.tokenizer.identity, "fingerprint": chat.tokenizer.fingerprint},
        "loss_mask": True,
        "records": kind,
        "chat_template": chat.template,
        "train_on": chat.train_on,
        "sources": source_record(files),
        "splits": splits,
    }
