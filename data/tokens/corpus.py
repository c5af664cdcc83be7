"""A text corpus as documents read lazily in pieces, however large its files.

Three kinds of source, all given by `data.path`:
- .txt files, or a directory of them: each file is one document (as the `datasets` "text"
  builder's `sample_by="document"` reads it: UTF-8, universal newlines), read in blocks, so a file
  of any size streams through bounded memory (the builder reads it into one Arrow string, which
  fails past 2 GiB).
- .json/.jsonl/.parquet files, or a directory of them: each row's `text_field` is a document, read
  through the `datasets` builder into memory-mapped Arrow files under a scratch folder.
- a `datasets.save_to_disk` folder: memory-mapped as it is, with its own validation split if it has one.
"""

from __future__ import annotations

import codecs
import io
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import datasets

# `datasets` (and pandas, pyarrow under it) is imported where rows are read: the config's checks import
# this module through the data kinds, and a launch's pre-flight must not pay for it.

BLOCK_BYTES = 1 << 22
"""A .txt file is read 4 MiB at a time: large enough that per-block overheads vanish."""
ROWS_PER_BATCH = 1024
ROW_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
TEXT_SUFFIX = ".txt"
VALIDATION_SPLITS = ("validation", "test")
SAVED_DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")

Document = Iterator[str]
"""One document as consecutive pieces of its text."""


@dataclass(frozen=True)
class Corpus:
    """The documents of each split, re-readable (a char vocabulary needs two passes)."""

    files: list[Path]
    """Every file the tokens depend on: what the cache key records."""
    splits: dict[str, Callable[[], Iterator[Document]]]
    """'train', and 'validation' where the source has its own."""
    work: dict[str, int]
    """How much each split has to read, in `unit`s: the progress bar's total."""
    unit: str  # "B" (bytes of text files) or "rows"
    scratch: Path | None = None


def corpus_files(paths: Sequence[Path]) -> list[Path]:
    """Every file the corpus at `paths` is read from, without reading any: the cache key's input."""
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path: {path} does not exist")
    if len(paths) == 1 and paths[0].is_dir() and is_saved_dataset(paths[0]):
        return sorted(p for p in paths[0].rglob("*") if p.is_file())
    return _corpus_files(paths)


def open_corpus(paths: Sequence[Path], text_field: str, scratch: Path) -> Corpus:
    """The corpus at `paths` (checked to exist). Row formats are staged into `scratch`, which the
    caller removes once the tokens are written."""
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path: {path} does not exist")
    if len(paths) == 1 and paths[0].is_dir() and is_saved_dataset(paths[0]):
        return _saved_dataset(paths[0], text_field)
    files = _corpus_files(paths)
    for path in files:
        if path.stat().st_size == 0:
            raise ValueError(f"data.path: {path} is empty")
    if files[0].suffix.lower() == TEXT_SUFFIX:
        return Corpus(
            files,
            {"train": lambda: (_text_file(path) for path in files)},
            {"train": sum(path.stat().st_size for path in files)},
            "B",
        )
    import datasets
    import pyarrow

    builder = ROW_SUFFIXES[files[0].suffix.lower()]
    try:
        rows = datasets.load_dataset(
            builder, data_files=[str(path) for path in files], split="train", cache_dir=str(scratch)
        )
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException) as error:
        cause = error.__cause__ or error
        names = ", ".join(map(str, files))
        problem = f"{type(cause).__name__}: {cause}"
        raise ValueError(f"data.path: {names} could not be read as {builder} data: {problem}") from None
    source = ", ".join(map(str, files))
    _check_column(rows, text_field, source)
    return Corpus(files, {"train": lambda: _rows(rows, text_field, source)}, {"train": rows.num_rows}, "rows", scratch)


def _corpus_files(paths: Sequence[Path]) -> list[Path]:
    """The files of `paths`, a directory standing for its files of one supported suffix, sorted."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            if len(paths) > 1:
                raise ValueError(f"data.path: {path} is a directory; a directory must be the only data path")
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in {TEXT_SUFFIX, *ROW_SUFFIXES}
            )
            if not found:
                raise ValueError(
                    f"data.path: directory {path} holds no .txt, .json, .jsonl or .parquet files and is not a "
                    "datasets.save_to_disk folder"
                )
            files.extend(found)
        else:
            if path.suffix.lower() not in {TEXT_SUFFIX, *ROW_SUFFIXES}:
                raise ValueError(
                    f"data.path: {path} has unsupported suffix {path.suffix!r}; expected .txt, .json, .jsonl or "
                    ".parquet"
                )
            files.append(path)
    kinds = {"text" if p.suffix.lower() == TEXT_SUFFIX else ROW_SUFFIXES[p.suffix.lower()] for p in files}
    if len(kinds) > 1:
        raise ValueError(f"data.path: {', '.join(map(str, files))} mix formats; give files of one format")
    return files


def _text_file(path: Path) -> Document:
    """The file's text in blocks, decoded and newline-translated exactly as `open(path, encoding="utf-8")`
    reads it, so that the tokens equal those of the whole file read at once."""
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as error:
                where = f"{error.reason} near byte {handle.tell() - len(block) + error.start}"
                raise ValueError(f"data.path: {path} is not UTF-8 text ({where})") from None
            if text:
                yield text
        tail = decoder.decode(b"", final=True)
        if tail:
            yield tail


def is_saved_dataset(directory: Path) -> bool:
    """Whether `directory` was written by `datasets.save_to_disk` (rather than holding corpus files)."""
    return any((directory / marker).is_file() for marker in SAVED_DATASET_MARKERS)


def _saved_dataset(directory: Path, text_field: str) -> Corpus:
    import datasets

    try:
        saved = datasets.load_from_disk(str(directory))
    except FileNotFoundError as error:
        raise ValueError(f"data.path: {directory} is not a folder written by datasets.save_to_disk") from error
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    if isinstance(saved, datasets.Dataset):
        _check_column(saved, text_field, str(directory))
        return Corpus(
            files, {"train": lambda: _rows(saved, text_field, str(directory))}, {"train": saved.num_rows}, "rows"
        )
    if "train" not in saved:
        raise ValueError(f"data.path: {directory} has splits {sorted(saved)} but no 'train' split")
    names = {"train": "train"}
    held_out = next((split for split in VALIDATION_SPLITS if split in saved), None)
    if held_out is not None:
        names["validation"] = held_out
    for name in names.values():
        _check_column(saved[name], text_field, f"{directory} ({name})")
    return Corpus(
        files,
        {
            split: (lambda name=name: _rows(saved[name], text_field, f"{directory} ({name})"))
            for split, name in names.items()
        },
        {split: saved[name].num_rows for split, name in names.items()},
        "rows",
    )


def _check_column(dataset: datasets.Dataset, column: str, source: str) -> None:
    if column not in dataset.column_names:
        raise ValueError(
            f"data.text_field: {source} has no column {column!r} (columns: {', '.join(dataset.column_names)}); "
            "set data.text_field to the column that holds the text"
        )
    if dataset.num_rows == 0:
        raise ValueError(f"data.path: {source} contains no documents")


def _rows(dataset: datasets.Dataset, column: str, source: str) -> Iterator[Document]:
    for batch in dataset.select_columns([column]).iter(batch_size=ROWS_PER_BATCH):
        for text in batch[column]:
            if not isinstance(text, str):
                raise ValueError(f"data.text_field: {source} has rows whose {column!r} is not a string")
            yield iter((text,))
