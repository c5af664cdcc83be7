"""The config document the config tests change key by key (tests/unit/test_config.py and
tests/launched/test_config_launched.py), and a config as DeepSpeed's tutorials write one
(tests/unit/test_config_documents.py and the launched test that trains it)."""

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


# DeepSpeed's ZeRO-2 offload tutorial config as its users write it, comments and trailing comma
# included (DeepSpeed reads configs with hjson), with configs/tiny_gpt.json's model and data added.
COMMENTED_ZERO2_OFFLOAD = """\
{
  "train_batch_size": 8,
  "gradient_accumulation_steps": 1,
  "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
  "fp16": {"enabled": false},
  "zero_optimization": {
      "stage": 2,  # ZeRO-2
      // bucket sizes as DeepSpeed's configs write them
      "reduce_bucket_size": 5e8,
      "offload_optimizer": {"device": "cpu"}  # optional: offload optimizer states to CPU
  },
  /* the engine's own sections */
  "model": {"family": "gpt", "preset": "tiny", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 32},
  "data": {"type": "text", "path": null, "tokenizer": "char"},
}
"""
