"""Local text corpora turned into fixed-length samples of token ids for language modelling.

Documents are tokenized, joined into one stream and cut into windows of `seq_len + 1` tokens
(one every `seq_len` tokens, or for training every `data.stride` tokens): `seq_len` inputs and,
one token on, `seq_len` targets. Every position of every sample is a real token: no padding,
no mask.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.corpus import DEFAULT_CORPUS
from data.hf_local import load_local_dataset
from data.tokenizers import Tokenizer, load_tokenizer

BUILDER_BY_SUFFIX = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
VALIDATION_SPLITS = ("validation", "test")


class PackedTokens(Dataset):
    """`{"input_ids": long [seq_len], "labels": long [seq_len]}` samples of one stream: window k
    holds tokens k * stride ... k * stride + seq_len, the inputs its first `seq_len` and the labels
    its last. A tail shorter than a window is dropped.

    At the default stride, `seq_len`, consecutive windows share one token, so every token of the
    stream after the first is a target exactly once (Megatron's, GPT-NeoX's, nanoGPT's and
    torchtitan's samples). A stride below `seq_len` makes overlapping windows. At stride 1 a
    sample starts at every token, and shuffled sampling draws offsets as nanoGPT's random windows
    do, without replacement.
    """

    def __init__(self, tokens: Tensor, seq_len: int, stride: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        window = seq_len + 1
        # A view of the stream, not a copy: at stride 1 the windows share all but one token.
        self.windows = tokens.unfold(0, window, stride) if len(tokens) >= window else tokens.new_empty(0, window)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        # Copies, so a caller that edits its sample cannot corrupt the stream behind it.
        window = self.windows[index]
        return {"input_ids": window[:-1].clone(), "labels": window[1:].clone()}


@dataclass
class TextDatasets:
    train: PackedTokens
    validation: PackedTokens
    tokenizer: Tokenizer


def load_text_dataset(
    path: str | Path | Sequence[str | Path] | None,
    *,
    seq_len: int,
    tokenizer: str = "char",
    text_field: str = "text",
    validation_fraction: float = 0.1,
    stride: int | None = None,
) -> TextDatasets:
    """Read, tokenize and pack a local corpus; `path=None` means the embedded default corpus.

    A corpus without its own validation split keeps its first `1 - validation_fraction` of
    tokens for training and the rest for validation, as nanoGPT does: a contiguous tail
    rather than random samples, so no validation text also sits inside a training sample.
    `stride` spaces the training samples (see PackedTokens); validation is always cut at stride
    `seq_len`, so each validation token after the first is scored once.
    """
    paths = [DEFAULT_CORPUS] if path is None else _as_paths(path)
    source = ", ".join(str(p) for p in paths)
    train_documents, validation_documents = read_documents(paths, text_field)
    all_text = "".join(train_documents + (validation_documents or []))
    text_tokenizer = load_tokenizer(tokenizer, training_text=all_text)

    if validation_documents is None:
        stream = token_stream(train_documents, text_tokenizer)
        split = int(len(stream) * (1 - validation_fraction))
        train_tokens, validation_tokens = stream[:split], stream[split:]
    else:
        train_tokens = token_stream(train_documents, text_tokenizer)
        validation_tokens = token_stream(validation_documents, text_tokenizer)

    train, validation = PackedTokens(train_tokens, seq_len, stride), PackedTokens(validation_tokens, seq_len)
    if len(train) == 0 or len(validation) == 0:
        raise ValueError(
            f"{source} is too small: {len(train_tokens)} training and {len(validation_tokens)} validation "
            f"tokens make {len(train)} and {len(validation)} samples of seq_len {seq_len} (each spans "
            f"{seq_len + 1} tokens: {seq_len} inputs and the token after them, the last target), and each needs "
            "at least one; use a larger corpus, a smaller seq_len or another validation_fraction"
        )
    return TextDatasets(train=train, validation=validation, tokenizer=text_tokenizer)


def read_documents(paths: Sequence[Path], text_field: str) -> tuple[list[str], list[str] | None]:
    """Return (training documents, validation documents or None when the source has no such split).

    A .txt file is one document; .json/.jsonl/.parquet give one document per row of `text_field`;
    a directory must be a `datasets.save_to_disk` output.
    """
    for path in paths:
        if not path.exists():
            raise ValueError(f"data.path: {path} does not exist")
    if len(paths) == 1 and paths[0].is_dir():
        return _read_saved_dataset(paths[0], text_field)

    builder = _builder_for(paths)
    for path in paths:
        if path.stat().st_size == 0:
            raise ValueError(f"data.path: {path} is empty")
    options = {"sample_by": "document"} if builder == "text" else {}
    dataset = load_local_dataset(builder, data_files=[str(p) for p in paths], split="train", **options)
    column = "text" if builder == "text" else text_field
    return _text_column(dataset, column, ", ".join(str(p) for p in paths)), None


def token_stream(documents: Sequence[str], tokenizer: Tokenizer) -> Tensor:
    """Concatenate the documents' ids, with the tokenizer's end-of-text id between documents."""
    ids: list[int] = []
    for i, document in enumerate(documents):
        if i > 0 and tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        ids.extend(tokenizer.encode(document))
    return torch.tensor(ids, dtype=torch.long)


def _as_paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    if not paths:
        raise ValueError("data.path is an empty list; give at least one file")
    return paths


def _builder_for(paths: Sequence[Path]) -> str:
    builders = set()
    for path in paths:
        if path.is_dir():
            raise ValueError(f"{path} is a directory; a directory must be the only data path")
        builder = BUILDER_BY_SUFFIX.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"data file {path} has unsupported suffix {path.suffix!r}; "
                f"expected one of {', '.join(BUILDER_BY_SUFFIX)}"
            )
        builders.add(builder)
    if len(builders) > 1:
        raise ValueError(f"data files {', '.join(map(str, paths))} mix formats; give files of one format")
    return builders.pop()


def _read_saved_dataset(directory: Path, text_field: str) -> tuple[list[str], list[str] | None]:
    try:
        saved = datasets.load_from_disk(str(directory))
    except FileNotFoundError as error:
        raise ValueError(f"{directory} is a directory but not one written by datasets.save_to_disk") from error
    if isinstance(saved, datasets.Dataset):
        return _text_column(saved, text_field, str(directory)), None
    if "train" not in saved:
        raise ValueError(f"{directory} has splits {sorted(saved)} but no 'train' split")
    validation_split = next((split for split in VALIDATION_SPLITS if split in saved), None)
    train = _text_column(saved["train"], text_field, f"{directory} (train)")
    if validation_split is None:
        return train, None
    return train, _text_column(saved[validation_split], text_field, f"{directory} ({validation_split})")


def _text_column(dataset: datasets.Dataset, column: str, source: str) -> list[str]:
    if column not in dataset.column_names:
        raise ValueError(
            f"{source} has no column {column!r} (columns: {', '.join(dataset.column_names)}); "
            "set data.text_field to the column that holds the text"
        )
    documents = list(dataset[column])
    if not documents:
        raise ValueError(f"{source} contains no documents")
    if not all(isinstance(document, str) for document in documents):
        raise ValueError(f"{source} has rows whose {column!r} is not a string")
    return documents
