"""Helpers shared by every model family module."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

AUTO = "auto"

# The label every family's loss and evaluation skip (torch's and transformers' default): evaluation
# gives the samples it repeats to fill its batches no weight with it (data/loader.make_eval_loader).
IGNORE_INDEX = -100


def merge_preset(family: str, presets: Mapping[str, Mapping[str, Any]], section: Mapping[str, Any]) -> dict[str, Any]:
    """The preset named by `section["preset"]`, with every field the section sets (not None) taking over.

    None counts as unset so that a config can spell out a key without pinning it.
    """
    name = section.get("preset")
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


def count_parameters(module: torch.nn.Module) -> int:
    """Unique parameters: `parameters()` yields a tied tensor once, so tied embeddings count once."""
    return sum(parameter.numel() for parameter in module.parameters())


def check_state_dict(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> None:
    """Refuse a state dict whose names or shapes differ from the model's.

    Exporting is the last step of a run; a prefixed or truncated state dict must fail here rather
    than produce a directory that loads with freshly initialised weights.
    """
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    mismatched = sorted(
        f"{key} {tuple(given[key].shape)} != {tuple(expected[key].shape)}"
        for key in set(expected) & set(given)
        if given[key].shape != expected[key].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched))
        if keys
    ]
    if problems:
        raise ValueError("state dict does not match the configured model; " + "; ".join(problems))


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (a ResNet's batch-norm statistics), by name: the model's state
    that no optimizer keeps and that each rank updates on its own."""
    parameters = {id(parameter) for parameter in module.parameters()}
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) not in parameters}


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch alike on every rank, so that every rank builds the same weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
