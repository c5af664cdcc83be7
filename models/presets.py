"""A model section as a family builds it: its preset, with every field the section sets taking over."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A value the engine settles before a model is built (model.vocab_size, data.seq_len).
AUTO = "auto"


def merge_preset(family: str, presets: Mapping[str, Mapping[str, Any]], section: Mapping[str, Any]) -> dict[str, Any]:
    """The preset named by `section["preset"]`, with every field the section sets (not None) taking over.

    None counts as unset so that a config can spell out a key without pinning it.
    """
    name = section.get("preset")
    if name is None:
        # Only a model.init_from directory's config.json leaves it out, having given every field
        # (engine/config/pretrained.py).
        return {key: section.get(key) for key in next(iter(presets.values()))}
    if name not in presets:
        choices = ", ".join(presets)
        raise ValueError(f"model.preset {name!r} is not a {family} preset; choose one of: {choices}")
    merged = dict(presets[name])
    for key in merged:
        if section.get(key) is not None:
            merged[key] = section[key]
    return merged


def setting(section: Mapping[str, Any], key: str, default: Any) -> Any:
    """A section value, or `default` when it is absent or None (the schema fills defaults, tests may not)."""
    value = section.get(key)
    return default if value is None else value
