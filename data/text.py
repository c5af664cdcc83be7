"""Local text corpora turned into fixed-length samples of token ids for language modelling.

Documents are tokenized once into a cached token file (data/tokens/), joined into one stream
and cut into windows of `seq_len + 1` tokens
(one every `seq_len` tokens, or for training every `data.stride` tokens): `seq_len` inputs and,
one token on, `seq_len` targets. Every position of every sample is a real token: no padding,
no mask.

The datasets here are map-style as torch's DataLoader reads them (a length, a sample per index)
without subclassing torch's Dataset, and import torch only to make a sample: `validate` builds them
to check the data, and answers sooner than importing torch would take.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.corpus import DEFAULT_CORPUS
from data.tokenizers import Tokenizer
from data.tokens.cache import default_cache_dir
from data.tokens.prepare import prepare_text

if TYPE_CHECKING:
    from torch import Tensor


class PackedTokens:
    """`{"input_ids": long [seq_len], "labels": long [seq_len]}` samples of one stream: window k
    holds tokens k * stride ... k * stride + seq_len, the inputs its first `seq_len` and the labels
    its last. A tail shorter than a window is dropped.

    At the default stride, `seq_len`, consecutive windows share one token, so every token of the
    stream after the first is a target exactly once (Megatron's, GPT-NeoX's, nanoGPT's and
    torchtitan's samples). A stride below `seq_len` makes overlapping windows. At stride 1 a
    sample starts at every token, and shuffled sampling draws offsets as nanoGPT's random windows
    do, without replacement.

    The stream is any 1-D integer array, normally a memory-mapped token file: a sample reads its
    window's pages alone, so memory stays flat however large the corpus, and the ranks of a node
    share one copy in the page cache.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, stride: int | None = None) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {seq_len}")
        stride = seq_len if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.tokens, self.seq_len, self.stride = tokens, seq_len, stride
        self._windows = (len(tokens) - seq_len - 1) // stride + 1 if len(tokens) > seq_len else 0

    def __len__(self) -> int:
        return self._windows

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        import torch

        if not 0 <= index < self._windows:
            raise IndexError(f"window {index} of {self._windows}")
        start = index * self.stride
        # A copy in int64: the model's embedding takes long ids, and the memory map stays read-only.
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1].clone(), "labels": window[1:]}


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
    cache_dir: str | Path | None = None,
    cache_timeout_s: float = 3600,
    held_out_only: bool = False,
) -> TextDatasets:
    """Tokenize a local corpus once into the token cache (or find it there) and cut its windows;
    `path=None` means the embedded default corpus, `cache_dir=None` the default cache.

    A corpus without its own validation split keeps its first `1 - validation_fraction` of
    tokens for training and the rest for validation, as nanoGPT does: a contiguous tail
    rather than random samples, so no validation text also sits inside a training sample.
    `stride` spaces the training samples (see PackedTokens); validation is always cut at stride
    `seq_len`, so each validation token after the first is scored once. `held_out_only` makes the
    whole corpus (its validation split, where it has one) the validation set, and `train` empty.
    """
    paths = text_paths(path)
    prepared, text_tokenizer = prepare_text(
        paths,
        tokenizer=tokenizer,
        text_field=text_field,
        cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
        timeout_s=cache_timeout_s,
    )
    if held_out_only:
        validation_tokens = prepared.tokens(prepared.splits[-1])
        train_tokens = validation_tokens[:0]
    elif "validation" in prepared.splits:
        train_tokens, validation_tokens = prepared.tokens("train"), prepared.tokens("validation")
    else:
        stream = prepared.tokens("train")
        split = int(len(stream) * (1 - validation_fraction))
        train_tokens, validation_tokens = stream[:split], stream[split:]

    train, validation = PackedTokens(train_tokens, seq_len, stride), PackedTokens(validation_tokens, seq_len)
    if (len(train) == 0 and not held_out_only) or len(validation) == 0:
        source = ", ".join(str(p) for p in paths)
        raise ValueError(
            f"{source} is too small: {len(train_tokens)} training and {len(validation_tokens)} validation "
            f"tokens make {len(train)} and {len(validation)} samples of seq_len {seq_len} (each spans "
            f"{seq_len + 1} tokens: {seq_len} inputs and the token after them, the last target), and each needs "
            "at least one; use a larger corpus, a smaller seq_len or another validation_fraction"
        )
    return TextDatasets(train=train, validation=validation, tokenizer=text_tokenizer)


def text_paths(path: str | Path | Sequence[str | Path] | None) -> list[Path]:
    """`data.path` as a list of paths; None is the embedded default corpus."""
    if path is None:
        return [DEFAULT_CORPUS]
    paths = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    if not paths:
        raise ValueError("data.path is an empty list; give at least one file")
    return paths
