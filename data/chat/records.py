"""Chat and instruction records, read with the `datasets` library and checked one by one.

`data.path` names .jsonl files (one record a line), .json files (a list of records, or JSON Lines),
.parquet files, a directory of one of these, or a folder `datasets.save_to_disk` wrote (with its
own validation split where it has one). Each file is read on its own, so every problem names the
file and the record: records count from 1 in file order (a .jsonl file's line, blank lines aside).

A chat record holds `messages`: a list of turns, each a `role` (system, user, assistant, tool) and a
`content` string; other keys of a turn (a tool's name, say) pass through to the template. An
instruction record holds a prompt and a completion (field names configurable), which become a user
turn and an assistant turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data.tokens.corpus import ROW_SUFFIXES, SAVED_DATASET_MARKERS, VALIDATION_SPLITS, is_saved_dataset

if TYPE_CHECKING:
    import datasets

# `datasets` (and pandas, pyarrow under it) is imported where rows are read: the config's checks import
# this module through the data kinds, and a launch's pre-flight must not pay for it.

ROLES = ("system", "user", "assistant", "tool")
ROWS_PER_BATCH = 1024

Message = dict[str, Any]
Conversation = list[Message]
ToConversation = Callable[[Mapping[str, Any], str], Conversation]
"""A record and where it is ("FILE record N") to its checked conversation; a ValueError naming
that place for a bad record."""


@dataclass(frozen=True)
class RecordFile:
    """One source of records: a file, or one split of a save_to_disk folder."""

    label: str
    rows: datasets.Dataset


def record_files(paths: Sequence[Path]) -> list[Path]:
    """Every file the records at `paths` are read from, without reading any: the cache key's input."""
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path: {path} does not exist")
    if len(paths) == 1 and paths[0].is_dir() and is_saved_dataset(paths[0]):
        return sorted(p for p in paths[0].rglob("*") if p.is_file())
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            if len(paths) > 1:
                raise ValueError(f"data.path: {path} is a directory; a directory must be the only data path")
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in ROW_SUFFIXES)
            if not found:
                raise ValueError(
                    f"data.path: directory {path} holds no .jsonl, .json or .parquet files and is not a "
                    f"datasets.save_to_disk folder (none of {', '.join(SAVED_DATASET_MARKERS)})"
                )
            files.extend(found)
        elif path.suffix.lower() not in ROW_SUFFIXES:
            raise ValueError(
                f"data.path: {path} has suffix {path.suffix!r}; conversations are read from .jsonl, .json or "
                ".parquet files, or a datasets.save_to_disk folder"
            )
        else:
            files.append(path)
    return files


def open_records(paths: Sequence[Path], scratch: Path) -> dict[str, list[RecordFile]]:
    """The record files of each split: "train", and "validation" where a save_to_disk folder has
    its own. Files are staged as Arrow under `scratch`, which the caller removes."""
    files = record_files(paths)
    if len(paths) == 1 and paths[0].is_dir() and is_saved_dataset(paths[0]):
        return _saved_dataset(paths[0])
    return {"train": [_read_file(path, scratch / str(index)) for index, path in enumerate(files)]}


def _read_file(path: Path, scratch: Path) -> RecordFile:
    if path.stat().st_size == 0:
        raise ValueError(f"data.path: {path} is empty")
    import datasets
    import pyarrow

    builder = ROW_SUFFIXES[path.suffix.lower()]
    try:
        rows = datasets.load_dataset(builder, data_files=[str(path)], split="train", cache_dir=str(scratch))
    except (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, ValueError) as error:
        cause = error.__cause__ or error
        raise ValueError(
            f"data.path: {path} could not be read as {builder} records: {type(cause).__name__}: {cause}"
        ) from None
    return RecordFile(str(path), rows)


def _saved_dataset(directory: Path) -> dict[str, list[RecordFile]]:
    import datasets

    try:
        saved = datasets.load_from_disk(str(directory))
    except FileNotFoundError as error:
        raise ValueError(f"data.path: {directory} is not a folder written by datasets.save_to_disk") from error
    if isinstance(saved, datasets.Dataset):
        return {"train": [RecordFile(str(directory), saved)]}
    if "train" not in saved:
        raise ValueError(f"data.path: {directory} has splits {sorted(saved)} but no 'train' split")
    splits = {"train": [RecordFile(f"{directory} (train)", saved["train"])]}
    held_out = next((split for split in VALIDATION_SPLITS if split in saved), None)
    if held_out is not None:
        splits["validation"] = [RecordFile(f"{directory} ({held_out})", saved[held_out])]
    return splits


def conversations(file: RecordFile, to_conversation: ToConversation) -> Iterator[tuple[Conversation, str]]:
    """The file's records as checked conversations, in order, each with where it is ("FILE record N")."""
    if file.rows.num_rows == 0:
        raise ValueError(f"data.path: {file.label} holds no records")
    number = 0
    for batch in file.rows.iter(batch_size=ROWS_PER_BATCH):
        columns = list(batch)
        for row in range(len(batch[columns[0]]) if columns else 0):
            number += 1
            where = f"{file.label} record {number}"
            yield to_conversation({column: batch[column][row] for column in columns}, where), where


def chat_conversation(record: Mapping[str, Any], where: str) -> Conversation:
    """A chat record's `messages`, checked; keys a reader filled with null for this record are dropped
    (a JSON or parquet reader gives every record every key any record has)."""
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        keys = ", ".join(key for key, value in record.items() if value is not None) or "none"
        problem = "has no 'messages'" if messages is None else "has 'messages' that is not a list of turns"
        raise ValueError(
            f"{where}: {problem} (its keys: {keys}); a chat record holds a list of messages, each with a role and "
            'content (data.type "instruction" reads prompt/completion pairs)'
        )
    conversation = []
    for index, message in enumerate(messages, start=1):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{where}: message {index} is {type(message).__name__}, not an object with role and content"
            )
        message = {key: value for key, value in message.items() if value is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                problem = "has no" if key not in message else "has a non-string"
                raise ValueError(f"{where}: message {index} {problem} {key!r}; every message needs a role and content")
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: message {index} has role {message['role']!r}; roles are {', '.join(ROLES)}")
        conversation.append(message)
    return conversation


def instruction_conversation(prompt_field: str, completion_field: str) -> ToConversation:
    """An instruction record as a user turn (its prompt) and an assistant turn (its completion)."""
    fields = {prompt_field: "data.prompt_field", completion_field: "data.completion_field"}

    def to_conversation(record: Mapping[str, Any], where: str) -> Conversation:
        for name, setting in fields.items():
            if not isinstance(record.get(name), str):
                keys = ", ".join(key for key, value in record.items() if value is not None) or "none"
                problem = "has no" if record.get(name) is None else "has a non-string"
                raise ValueError(f"{where}: {problem} {name!r} ({setting}; its keys: {keys})")
        return [
            {"role": "user", "content": record[prompt_field]},
            {"role": "assistant", "content": record[completion_field]},
        ]

    return to_conversation
