"""Training and validation samples from token files users already hold (`data.type: "tokens"`),
several files blended by weight as Megatron blends its `--data-path`.

Each file is cut into its own windows (a window never spans two files). With one file those
windows are the dataset; with several, sample i is drawn from the file that megatron-core's
`build_blending_indices` assigns it, so the blend's proportions are Megatron's to the sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.text import PackedTokens
from data.tokenizers import Tokenizer, load_tokenizer
from data.tokens.external import (
    TokenFile,
    Vocabulary,
    import_megatron,
    open_token_file,
    refuse_ids_outside,
    scan_token_ids,
)

if TYPE_CHECKING:
    from torch import Tensor
    from torch.utils.data import Dataset

MAX_SOURCES = 32767
"""Megatron's dataset index is int16."""


class BlendedTokens:
    """Samples of several map-style datasets in the proportions of `weights`.

    Sample i is window `dataset_sample_index[i] % len(source)` of source `dataset_index[i]`, both
    from megatron-core's helpers. With `weights`, they are normalised as Megatron does and
    `build_blending_indices` places `size` samples (default: the sources' windows together, so one
    pass sees about every window once) so that after every prefix each source's share is within one
    sample of its weight. A source weighted above its size wraps around and repeats; one weighted
    below it leaves windows unseen in that pass. Without weights, `build_exhaustive_blending_indices`
    takes every window exactly once, interleaved in proportion to the sources' sizes (Megatron's
    blend without weights).

    The two indices take 10 bytes a sample (int16 and int64, the types Megatron's helpers write
    into): 500 MB for 50M samples, 100B tokens at seq_len 2048. Memory, not disk, for this engine's
    corpora; Megatron caches them as .npy files for larger ones.
    """

    def __init__(self, sources: Sequence[Dataset], weights: Sequence[float] | None, size: int | None = None) -> None:
        self.sources = list(sources)
        self.source_sizes = [len(source) for source in self.sources]
        if not self.sources or min(self.source_sizes) == 0 or len(self.sources) > MAX_SOURCES:
            raise ValueError(f"a blend needs 1 to {MAX_SOURCES} sources of at least one sample each")
        helpers = import_megatron("megatron.core.datasets.helpers")
        if weights is None:
            self.weights = [count / sum(self.source_sizes) for count in self.source_sizes]
            size = sum(self.source_sizes)
            self.dataset_index = np.zeros(size, dtype=np.int16)
            self.dataset_sample_index = np.zeros(size, dtype=np.int64)
            helpers.build_exhaustive_blending_indices(
                self.dataset_index,
                self.dataset_sample_index,
                np.asarray(self.source_sizes, dtype=np.int64),
                len(self.sources),
            )
        else:
            if len(weights) != len(self.sources):
                raise ValueError(f"{len(weights)} weights for {len(self.sources)} sources")
            self.weights = import_megatron("megatron.core.datasets.utils").normalize(list(weights))
            size = sum(self.source_sizes) if size is None else size
            # Exactly int16 and int64: pybind11 would hand the helper a converted copy of any other
            # type and the indices written into it would be lost.
            self.dataset_index = np.zeros(size, dtype=np.int16)
            self.dataset_sample_index = np.zeros(size, dtype=np.int64)
            helpers.build_blending_indices(
                self.dataset_index, self.dataset_sample_index, self.weights, len(self.sources), size, False
            )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self.dataset_index):
            raise IndexError(f"sample {index} of {len(self.dataset_index)}")
        source = int(self.dataset_index[index])
        return self.sources[source][int(self.dataset_sample_index[index]) % self.source_sizes[source]]


@dataclass
class TokenDatasets:
    train: Dataset
    validation: Dataset
    tokenizer: Tokenizer | None
    """The tokenizer that wrote the files (their metadata's, or data.tokenizer's); None where none says."""
    vocab_size: int | None
    """The tokenizer's vocabulary, or a metadata's bare vocab_size; None: the model config must give it."""
    max_id: int
    """The largest id in any file, training or validation."""
    files: list[TokenFile]
    """Training files, then validation files: what `check_ids_below` takes."""
    weights: list[float] | None
    """data.weights normalised as Megatron does; None: in proportion to each file's windows."""


def load_token_datasets(
    paths: str | Path | Sequence[str | Path],
    *,
    weights: Sequence[float] | None = None,
    validation_paths: str | Path | Sequence[str | Path] | None = None,
    dtype: str | None = None,
    tokenizer: str = "char",
    seq_len: int,
    stride: int | None = None,
    validation_fraction: float = 0.1,
    cache_dir: str | Path | None = None,
) -> TokenDatasets:
    """Open the token files a `data.type: "tokens"` config names and cut them into samples.

    Training windows (every `stride` tokens) come from each data.path entry, blended by `weights`.
    Validation windows (stride `seq_len`) come from `validation_paths`, blended in proportion to their
    sizes, each window once; without them each entry's last `validation_fraction` of tokens is held
    out (cut where load_text_dataset cuts) and the tails are blended by the same weights as training,
    so validation scores the training mixture. A blend rather than one file after another: an
    evaluation reads a prefix of the set, which in file order would score the first file alone.

    `tokenizer` is data.tokenizer: "char" (the default) takes the tokenizer from the files' metadata;
    "byte" or a tokenizer directory names it, and the metadata must agree. `cache_dir` holds the id
    scans (None: data.tokens.cache.default_cache_dir()). Files of one run must share one tokenizer.
    """
    train_entries = _entries(paths, "data.path")
    validation_entries = None if validation_paths is None else _entries(validation_paths, "data.validation_path")
    normalized = _normalized_weights(weights, len(train_entries))
    configured = _configured_tokenizer(tokenizer)
    stride = seq_len if stride is None else stride
    cache = None if cache_dir is None else Path(cache_dir)

    train_files = [open_token_file(p, dtype=dtype, where=w, tokenizer=configured) for w, p in train_entries]
    validation_files = [
        open_token_file(p, dtype=dtype, where=w, tokenizer=configured) for w, p in validation_entries or []
    ]
    files = train_files + validation_files
    vocabulary = common_vocabulary(files)
    ranges = [scan_token_ids(file, cache_dir=cache) for file in files]
    refuse_ids_outside(
        files,
        ranges,
        vocabulary.size,
        vocabulary=f"the vocabulary of its tokenizer ({vocabulary.origin})",
        remedy="it was not written with this tokenizer, or data.dtype is not the type it was written in",
    )

    if validation_entries is None:
        train_parts, validation_parts = _split_windows(train_files, seq_len, stride, validation_fraction)
        validation_weights = normalized
    else:
        train_parts = [_whole_file_windows(file, seq_len, stride) for file in train_files]
        validation_parts = [_whole_file_windows(file, seq_len, seq_len) for file in validation_files]
        validation_weights = None
    return TokenDatasets(
        train=_blend(train_parts, normalized),
        validation=_blend(validation_parts, validation_weights),
        tokenizer=vocabulary.tokenizer,
        vocab_size=vocabulary.size,
        max_id=max(ids.highest for ids in ranges),
        files=files,
        weights=normalized,
    )


def common_vocabulary(files: Sequence[TokenFile]) -> Vocabulary:
    """The one tokenizer every file was written with; a blend of differently tokenized files is an error
    (the same id would be one token in one file and another token in the next)."""
    first = files[0]
    for file in files[1:]:
        if file.vocabulary.identity != first.vocabulary.identity:
            raise ValueError(
                f"{file.label} has {file.vocabulary.describe()}, but {first.label} has "
                f"{first.vocabulary.describe()}; the files of one run must share one tokenizer (set data.tokenizer "
                "to name it where a file records none)"
            )
    return first.vocabulary


def _entries(paths: str | Path | Sequence[str | Path] | None, field: str) -> list[tuple[str, str]]:
    """(config path, file) per entry: a lone string is `data.path`, a list's entries `data.path[i]`."""
    if paths is None:
        raise ValueError(f'{field}: data.type "tokens" needs token files: a flat .bin or a Megatron prefix')
    if isinstance(paths, str | Path):
        return [(field, str(paths))]
    entries = [(f"{field}[{i}]", str(path)) for i, path in enumerate(paths)]
    if not entries:
        raise ValueError(f"{field} is an empty list; give at least one token file")
    if len(entries) > MAX_SOURCES:
        raise ValueError(f"{field}: {len(entries)} files; a blend takes at most {MAX_SOURCES}")
    return entries


def _normalized_weights(weights: Sequence[float] | None, count: int) -> list[float] | None:
    if weights is None:
        return None
    weights = list(weights)
    if len(weights) != count:
        raise ValueError(
            f"data.weights: {len(weights)} weights for {count} data.path entries; give one per entry, in order"
        )
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(
                f"data.weights[{i}]: {weight!r} is not a positive number; every entry needs a weight above 0 "
                "(leave a file out of data.path rather than weighting it 0)"
            )
    return import_megatron("megatron.core.datasets.utils").normalize(weights)


def _configured_tokenizer(spec: str) -> Tokenizer | None:
    """data.tokenizer's tokenizer; None for "char", which for token files means "what their metadata says"."""
    if spec == "char":
        return None
    try:
        return load_tokenizer(spec, None)
    except ValueError as error:
        raise ValueError(f"data.tokenizer: {error}") from error


def _split_windows(
    files: Sequence[TokenFile], seq_len: int, stride: int, validation_fraction: float
) -> tuple[list[PackedTokens], list[PackedTokens]]:
    """Each file's head for training and its last `validation_fraction` for validation."""
    train, validation = [], []
    for file in files:
        total = len(file.tokens)
        cut = int(total * (1 - validation_fraction))
        head = f"its first {cut} of {total} tokens (those before data.validation_fraction {validation_fraction:g})"
        tail = f"its last {total - cut} of {total} tokens (data.validation_fraction {validation_fraction:g})"
        train.append(
            _windows(
                file,
                file.tokens[:cut],
                seq_len,
                stride,
                f"{head} make no training window",
                "lower data.seq_len or data.validation_fraction",
            )
        )
        validation.append(
            _windows(
                file,
                file.tokens[cut:],
                seq_len,
                seq_len,
                f"{tail} make no validation window",
                "lower data.seq_len, raise data.validation_fraction, or give data.validation_path",
            )
        )
    return train, validation


def _whole_file_windows(file: TokenFile, seq_len: int, stride: int) -> PackedTokens:
    what = f"its {len(file.tokens)} tokens make no window"
    return _windows(file, file.tokens, seq_len, stride, what, "lower data.seq_len, or drop the file")


def _windows(file: TokenFile, tokens: np.ndarray, seq_len: int, stride: int, what: str, fix: str) -> PackedTokens:
    windows = PackedTokens(tokens, seq_len, stride)
    if len(windows) == 0:
        raise ValueError(f"{file.label}: {what} of data.seq_len {seq_len} (each spans {seq_len + 1} tokens); {fix}")
    return windows


def _blend(parts: Sequence[PackedTokens], weights: Sequence[float] | None) -> Dataset:
    return parts[0] if len(parts) == 1 else BlendedTokens(parts, weights)
