"""One entry per kind of data (`data.type`): everything the engine knows of it. What its samples give
(tokens, images), its own config keys and checks, how its datasets are built, what the planner
counts of them, and how its tokens are prepared ahead of a launch.

Adding a kind means writing one module in data/kinds/ that exposes the names `_kind` reads
(building on data/kinds/common.py) and adding it to `KINDS`; the config schema, its rules,
`build_datasets`, the planner and `python -m engine prepare-data` ask the entry, and no code in
engine/ or models/ branches on a kind's name (tests/unit/test_chat_data.py greps for it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any

from data.bundle import SAMPLES, DataBundle
from data.kinds import chat, image, instruction, synthetic, text, tokens
from data.kinds.common import BuildRequest, Footprint, NothingToPrepare

__all__ = ["KINDS", "BuildRequest", "DataKind", "Footprint", "NothingToPrepare", "get_kind", "kind_schema"]


@dataclass(frozen=True)
class DataKind:
    """What the engine needs from a kind of data.

    `gives`: the samples it can give (SAMPLES). `schema`: the JSON Schema of the data-section keys
    only this kind reads; any other kind refuses them set away from their defaults. `path_needed`:
    what `data.path` must name, or None where null has a meaning (the embedded corpus, the chat
    sample) or no path is read. `reads_tokenizer`: data.tokenizer names its tokenizer ("char",
    "byte" or a Hugging Face directory; the kind refuses in `config_issues` what it cannot use).
    `masks_labels`: its training labels hold IGNORE_INDEX where no loss is taken (prompts, other
    roles' turns, padding), so micro-batches differ in their counts of targets.
    `path_exists(key, path, data)`: whether `path`, given in `data.<key>`, names something it can
    read. `config_issues(data)`: (JSON path, message) pairs for what the schema cannot say.
    `build(data, request)`: the bundle, before any process group; every problem with the data is
    one ValueError naming the file, record or field. `footprint(bundle)`: the planner's bytes.
    `prepare_ahead(data)`: tokenize into the token cache now (`python -m engine prepare-data`),
    returning what was prepared; NothingToPrepare where the kind reads its data as it is."""

    name: str
    gives: tuple[str, ...]
    schema: Mapping[str, Mapping[str, Any]]
    path_needed: str | None
    reads_tokenizer: bool
    masks_labels: bool
    path_exists: Callable[[str, str, Mapping[str, Any]], bool]
    config_issues: Callable[[Mapping[str, Any]], Iterator[tuple[str, str]]]
    build: Callable[[Mapping[str, Any], BuildRequest], DataBundle]
    footprint: Callable[[DataBundle], Footprint]
    prepare_ahead: Callable[[Mapping[str, Any]], str]


def _kind(name: str, module: ModuleType) -> DataKind:
    """Every kind module exposes the same names, so registering one takes a single line."""
    gives = tuple(module.GIVES)
    if not set(gives) <= set(SAMPLES):
        raise ValueError(f"data kind {name!r} gives {gives}; samples are {SAMPLES}")
    return DataKind(
        name=name,
        gives=gives,
        schema=MappingProxyType(module.SCHEMA),
        path_needed=module.PATH_NEEDED,
        reads_tokenizer=module.READS_TOKENIZER,
        masks_labels=module.MASKS_LABELS,
        path_exists=module.path_exists,
        config_issues=module.config_issues,
        build=module.build,
        footprint=module.footprint,
        prepare_ahead=module.prepare_ahead,
    )


KINDS: Mapping[str, DataKind] = MappingProxyType(
    {
        "text": _kind("text", text),
        "tokens": _kind("tokens", tokens),
        "chat": _kind("chat", chat),
        "instruction": _kind("instruction", instruction),
        "image": _kind("image", image),
        "synthetic": _kind("synthetic", synthetic),
    }
)


def get_kind(name: str) -> DataKind:
    if name not in KINDS:
        raise ValueError(f"data.type {name!r} is unknown; choose one of: {', '.join(KINDS)}")
    return KINDS[name]


def kind_schema() -> dict[str, Mapping[str, Any]]:
    """Every kind's own keys, for the data section's schema. A key two kinds share (chat and
    instruction data read the same template keys) must be described once, identically."""
    merged: dict[str, Mapping[str, Any]] = {}
    for kind in KINDS.values():
        for key, schema in kind.schema.items():
            if key in merged and merged[key] != schema:
                raise ValueError(f"data.{key} is described differently by two data kinds")
            merged[key] = schema
    return merged
