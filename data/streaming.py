"""A text corpus read lazily, for corpora that do not fit on local disk (`data.streaming: true`).

Rows come from `datasets.load_dataset(..., streaming=True)`, are split over the data-parallel
ranks with `split_dataset_by_node`, tokenized one at a time and packed into windows as a prepared
corpus is (data/tokens, `data.text.PackedTokens`): the tokenizer's end-of-text id between
documents, windows of `seq_len + 1` tokens one every `seq_len` tokens. Nothing is materialised:
memory holds one row and the tokens not yet cut into windows.

The position in the stream is a few integers (the dataset's own resumable state, at a row
boundary) plus the tokens read but not yet emitted, so a resumed run continues with exactly the
windows the interrupted run would have seen next (torchtitan's `HuggingFaceDataset` keeps the
same pair). Rows are not shuffled: a shuffle buffer's contents are lost on resume (datasets
refills it with other rows), which would break that exactness.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from data.tokenizers import Tokenizer
from data.tokens.corpus import ROW_SUFFIXES, TEXT_SUFFIX, corpus_files, is_saved_dataset

if TYPE_CHECKING:
    import datasets
    from torch import Tensor

# `datasets` is imported where a stream opens and torch where a window is made: the config's checks
# import this module through the data kinds, and a launch's pre-flight must not pay for either.

FILE_COLUMN = "file_index"
"""Added to the rows of .txt sources: which file a line came from, so a file's lines form one document."""


class TextRows(NamedTuple):
    """A source opened for streaming, not yet read."""

    rows: datasets.IterableDataset
    text_field: str
    lines_of_files: bool
    """True for .txt sources: rows are lines tagged with `FILE_COLUMN`, and a file's lines are one document."""


def open_text_stream(source: str | Path | Sequence[str | Path], text_field: str) -> TextRows:
    """Open `source` as a streaming dataset of rows, without reading it.

    `source` is local files of one format, one local directory (its .txt/.json/.jsonl/.parquet files,
    sorted, as `data.tokens.corpus` finds them), or a string naming no local path: a Hugging Face
    Hub dataset id, whose "train" split is streamed.

    .json/.jsonl/.parquet files and hub datasets give one document per row of `text_field`.
    A .txt file is read line by line with its line breaks kept, so no file is ever held whole
    (the builder reads 10 MB at a time), and its lines carry the file's index in `FILE_COLUMN`:
    consecutive lines of one file are concatenated without a separator, which keeps a file one
    document, as `data.text` makes it. With the byte tokenizer that is exactly the file's
    encoding; an HF tokenizer can differ only where its vocabulary merges a line break with
    what follows it (GPT-2's "\\n\\n"), the price of never holding a file whole.
    """
    import datasets

    files = _local_files(source)
    if files is None:
        return TextRows(datasets.load_dataset(str(source), split="train", streaming=True), text_field, False)
    data_files = [str(file) for file in files]
    if files[0].suffix.lower() != TEXT_SUFFIX:
        builder = ROW_SUFFIXES[files[0].suffix.lower()]
        rows = datasets.load_dataset(builder, data_files=data_files, split="train", streaming=True)
        return TextRows(rows, text_field, False)

    lines = datasets.load_dataset(
        "text", data_files=data_files, split="train", streaming=True, sample_by="line", keep_linebreaks=True
    )
    # One shard per file; tagging each before concatenating keeps split_dataset_by_node's unit a
    # whole file, and declaring the features spares concatenation a read of every file to infer them.
    features = datasets.Features({"text": datasets.Value("string"), FILE_COLUMN: datasets.Value("int64")})
    tagged = [
        lines.shard(num_shards=len(files), index=index).map(partial(_tag_with_file, index=index), features=features)
        for index in range(len(files))
    ]
    return TextRows(datasets.concatenate_datasets(tagged), "text", True)


class StreamedWindows:
    """One data-parallel rank's endless stream of `{"input_ids", "labels"}` windows (long [seq_len]).

    The rank's rows, in order, make one token stream with the tokenizer's `eos_id` (when it has
    one) between consecutive documents; window k holds tokens k * seq_len ... k * seq_len +
    seq_len, so consecutive windows share one token and every token after the first is a target
    once. When the rank's rows run out the next epoch reads them again from the start, in the
    same order, and the token stream simply goes on: a tail too short for a window is carried
    into the next epoch rather than dropped.

    Ranks are disjoint: `split_dataset_by_node` gives each rank whole files when the file (shard)
    count is a multiple of `dp_size`, and otherwise every `dp_size`-th row.

    `state_dict()` is the position after the last window yielded; `load_state_dict` on a fresh
    object makes it yield what this one yields next. The object is its own iterator.
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path],
        *,
        text_field: str,
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self._source = source
        self._rows, self._text_field, self._lines_of_files = open_text_stream(source, text_field)
        self._tokenizer, self._seq_len = tokenizer, seq_len
        self._dp_rank, self._dp_size = dp_rank, dp_size
        self._epoch = 0
        self._start_position: dict | None = None  # where the next pass over the rows starts; None: the beginning
        self._pass: datasets.IterableDataset | None = None  # the pass being read, whose state is the live position
        self._tokens: list[int] = []  # read but not yet emitted from self._offset on
        self._offset = 0
        self._started = False  # whether any document came before, so the next one is preceded by eos
        self._open_file: int | None = None  # a .txt source's file whose lines are being read
        self._windows: Iterator[dict[str, Tensor]] | None = None

    def __iter__(self) -> StreamedWindows:
        return self

    def __next__(self) -> dict[str, Tensor]:
        if self._windows is None:
            self._windows = self._generate()
        return next(self._windows)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last window yielded: small, and writable with `torch.save`."""
        import torch

        rows = self._pass.state_dict() if self._pass is not None else copy.deepcopy(self._start_position)
        return {
            "dp_rank": self._dp_rank,
            "dp_size": self._dp_size,
            "epoch": self._epoch,
            "rows": rows,
            "tokens": torch.tensor(self._tokens[self._offset :], dtype=torch.long),
            "started": self._started,
            "open_file": self._open_file,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the next window is the one that followed it when it was saved."""
        if state["dp_size"] != self._dp_size:
            raise ValueError(
                f"this data stream position was saved by {state['dp_size']} data-parallel ranks, each of which "
                f"had its own position in the stream, so the resume must run on {state['dp_size']} data-parallel "
                f"ranks, not {self._dp_size}"
            )
        if state["dp_rank"] != self._dp_rank:
            raise ValueError(
                f"this data stream position is data-parallel rank {state['dp_rank']}'s; rank {self._dp_rank} "
                "must load the position it saved itself"
            )
        self._epoch = state["epoch"]
        self._start_position = copy.deepcopy(state["rows"])
        self._pass = None
        self._tokens, self._offset = state["tokens"].tolist(), 0
        self._started, self._open_file = state["started"], state["open_file"]
        self._windows = None

    def _generate(self) -> Iterator[dict[str, Tensor]]:
        import torch
        from datasets.distributed import split_dataset_by_node

        eos = self._tokenizer.eos_id
        while True:
            rows = split_dataset_by_node(self._rows, rank=self._dp_rank, world_size=self._dp_size)
            from_beginning = self._start_position is None
            if not from_beginning:
                rows.load_state_dict(self._start_position)
            self._pass, tokens_read = rows, 0
            for row in rows:
                file_index = row[FILE_COLUMN] if self._lines_of_files else None
                continues_document = file_index is not None and file_index == self._open_file
                ids = self._tokenizer.encode(self._text_of(row))
                if self._started and eos is not None and not continues_document:
                    ids.insert(0, eos)
                self._started, self._open_file = True, file_index
                self._tokens.extend(ids)
                tokens_read += len(ids)
                while len(self._tokens) - self._offset > self._seq_len:
                    window = torch.tensor(
                        self._tokens[self._offset : self._offset + self._seq_len + 1], dtype=torch.long
                    )
                    self._offset += self._seq_len
                    yield {"input_ids": window[:-1], "labels": window[1:]}
                del self._tokens[: self._offset]
                self._offset = 0
            if from_beginning and tokens_read == 0:
                raise ValueError(
                    f"data.path: data-parallel rank {self._dp_rank} of {self._dp_size} read no text from "
                    f"{self._source}: its share of the rows is empty; use a larger corpus or fewer data-parallel ranks"
                )
            # The next epoch starts a new document even where a .txt source has a single file.
            self._epoch, self._start_position, self._pass, self._open_file = self._epoch + 1, None, None, None

    def _text_of(self, row: dict[str, Any]) -> str:
        text = row.get(self._text_field)
        if not isinstance(text, str):
            problem = "has no column" if self._text_field not in row else "has a row whose column is not a string:"
            raise ValueError(
                f"data.text_field: {self._source} {problem} {self._text_field!r} (columns: {', '.join(row)}); "
                "set data.text_field to the column that holds the text"
            )
        return text


@dataclass(frozen=True)
class StreamedCorpus:
    """The training side of a streaming config. It is opened only once the run knows its data-parallel
    rank (after the process group), and it has no length: a stream is not indexed."""

    source: str | list[str]
    text_field: str
    tokenizer: Tokenizer
    seq_len: int

    def windows(self, dp_rank: int, dp_size: int) -> StreamedWindows:
        return StreamedWindows(
            self.source,
            text_field=self.text_field,
            tokenizer=self.tokenizer,
            seq_len=self.seq_len,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )


def stream_micro_batches(windows: Iterable[dict[str, Tensor]], micro_batch_size: int) -> Iterator[dict[str, Tensor]]:
    """Stack consecutive windows into micro-batches; endless over a `StreamedWindows`.

    It takes exactly `micro_batch_size` windows per micro-batch and reads none ahead, so after
    k micro-batches the windows' `state_dict()` is the position of micro-batch k.
    """
    import torch

    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    iterator = iter(windows)
    while len(samples := list(islice(iterator, micro_batch_size))) == micro_batch_size:
        yield {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def is_hub_id(source: str) -> bool:
    """Whether `source` names a Hugging Face Hub dataset ("org/name") rather than a local path."""
    return not Path(source).exists() and not _looks_like_a_path(source)


def _local_files(source: str | Path | Sequence[str | Path]) -> list[Path] | None:
    """The local files `source` names, found as a prepared corpus finds them, or None for a hub id."""
    if isinstance(source, str) and is_hub_id(source):
        return None
    paths = [Path(source)] if isinstance(source, str | Path) else [Path(path) for path in source]
    if not paths:
        raise ValueError("data.path is an empty list; give at least one file")
    if len(paths) == 1 and is_saved_dataset(paths[0]):
        raise ValueError(
            f"data.path: {paths[0]} is a datasets.save_to_disk folder, which streaming does not read; it is on "
            "local disk already, so set data.streaming to false"
        )
    return corpus_files(paths)


def _looks_like_a_path(source: str) -> bool:
    """A missing local path, told apart from a hub id ("org/name"), so it is reported as missing."""
    return source.startswith(("/", ".", "~")) or Path(source).suffix.lower() in {TEXT_SUFFIX, *ROW_SUFFIXES}


def _tag_with_file(row: dict[str, Any], index: int) -> dict[str, int]:
    return {FILE_COLUMN: index}
