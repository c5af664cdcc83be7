"""A transformers checkpoint's config.json read as model-section fields, without transformers or
torch: `model.init_from` is settled while the config is checked (engine/config/pretrained.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def pretrained_values(saved: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """`names` as a checkpoint's config.json (`saved`) gives them; ValueError naming those it leaves
    out, whose transformers defaults (Llama's 4096 wide, 32 layers) no small checkpoint means."""
    missing = [name for name in names if saved.get(name) is None]
    if missing:
        raise ValueError(f"gives no {', '.join(missing)} in its config.json")
    return {name: saved[name] for name in names}


def refuse_unbuildable(saved: Mapping[str, Any], built_as: Mapping[str, Any]) -> None:
    """ValueError naming each value of a checkpoint's config.json (`saved`) other than the one the
    family always builds (`built_as`). A key left out takes the transformers class's default, which
    is that value (tests/unit/test_init_from.py compares them)."""
    differences = [
        f"{name} {json.dumps(saved[name])} (this family builds {json.dumps(value)})"
        for name, value in built_as.items()
        if saved.get(name, value) != value
    ]
    if differences:
        raise ValueError(f"has {', '.join(differences)}, which no model field configures")
