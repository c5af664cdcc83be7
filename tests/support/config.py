"""The config document the config tests change key by key (tests/unit/test_config.py and
tests/launched/test_config_launched.py)."""

from __future__ import annotations

import copy

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "model": {"family": "gpt", "preset": "tiny", "n_embd": 32, "n_head": 2},
    "data": {"type": "text"},
}


def with_changes(**changes) -> dict:
    document = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        target = document
        *parents, last = dotted.split("__")
        for key in parents:
            target = target.setdefault(key, {})
        target[last] = value
    return document
