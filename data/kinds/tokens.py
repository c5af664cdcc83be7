"""data.type "tokens": token files users already hold (nanoGPT's flat .bin, Megatron/GPT-NeoX
.bin/.idx), memory-mapped and blended by data.weights (data/tokens/blend.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from data.bundle import DataBundle
from data.kinds.common import BuildRequest, Footprint, NothingToPrepare, first_sample_bytes
from data.kinds.text import cache_dir, token_bytes
from data.text import PackedTokens
from data.tokens.blend import BlendedTokens, load_token_datasets

GIVES = ("tokens",)
PATH_NEEDED = "token files"
READS_TOKENIZER = True
MASKS_LABELS = False
SCHEMA = {
    "weights": {
        "anyOf": [{"type": "array", "items": {"type": "number"}, "minItems": 1}, {"type": "null"}],
        "description": "tokens: one positive weight per data.path entry; training samples are drawn from each in "
        "these proportions, as Megatron blends its --data-path (normalised, so [3, 1] is [0.75, 0.25]). null: "
        "in proportion to each file's samples.",
        "default": None,
    },
    "dtype": {
        "enum": [None, "uint8", "uint16", "int32", "uint32", "int64"],
        "description": "tokens: the integer type of a flat .bin. null: what its metadata (this engine's "
        "meta.json beside it) records, else uint16 as nanoGPT writes it. A Megatron .idx names its own.",
        "default": None,
    },
}


def path_exists(key: str, path: str, data: Mapping[str, Any]) -> bool:
    """A Megatron dataset is named by its prefix (`corpus_text_document` stands for its .bin and .idx)."""
    return os.path.exists(path) or os.path.exists(path + ".bin")


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    weights = data["weights"]
    if weights is None:
        return
    paths = data["path"] if isinstance(data["path"], list) else [data["path"]]
    if len(weights) != len(paths):
        yield "data.weights", f"{len(weights)} weight(s) for {len(paths)} data.path entries; give one weight per entry"
    for index, weight in enumerate(weights):
        if weight <= 0:
            what = f" ({paths[index]!r})" if index < len(paths) else ""
            yield f"data.weights[{index}]", f"{weight} is not positive; the blend entry{what} needs a weight > 0"


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    tokens = load_token_datasets(
        data["path"],
        weights=data.get("weights"),
        validation_paths=data.get("validation_path"),
        dtype=data.get("dtype"),
        tokenizer=data["tokenizer"],
        seq_len=request.seq_len,
        stride=data.get("stride", request.seq_len),
        validation_fraction=data["validation_fraction"],
        cache_dir=cache_dir(data),
    )
    return DataBundle(
        "tokens", tokens.train, tokens.validation, tokens.tokenizer, tokens.vocab_size, None, tokens.files
    )


def footprint(bundle: DataBundle) -> Footprint:
    """The files' windows, and Megatron's two blending indices, each rank's own: the source and the
    sample in it."""
    windows: list[PackedTokens] = []
    blend_index = 0
    for dataset in (bundle.train, bundle.validation):
        if isinstance(dataset, BlendedTokens):
            blend_index += dataset.dataset_index.nbytes + dataset.dataset_sample_index.nbytes
            windows.extend(dataset.sources)
        else:
            windows.append(dataset)
    loaded, mapped = token_bytes(windows)
    return Footprint(first_sample_bytes(bundle.train), loaded, mapped, blend_index)


def prepare_ahead(data: Mapping[str, Any]) -> str:
    raise NothingToPrepare('has data.type "tokens", already tokenized')
