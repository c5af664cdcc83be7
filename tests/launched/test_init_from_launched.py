"""A run started from nothing but a pretrained directory: a config naming `model.init_from` and the
data, no preset, no tokenizer. The resolved config records the directory's architecture and
tokenizer, and the first step's loss is the loss transformers' own `from_pretrained` model
computes on the same first batch. The config-stage checks are in tests/unit/test_init_from.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from data.loader import make_train_loader
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data, settle_vocabulary
from models.labels import IGNORE_INDEX
from tests.support.compare import LOSS_TOLERANCE
from tests.support.launch import read_run, run_single
from tests.support.pretrained import write_tiny_llama

# All a user writes: the directory decides the model and the tokenizer.
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "bf16": {"enabled": False},
    "model": {"family": "llama", "init_from": None},
    "data": {"type": "text", "seq_len": 32},
    "trainer": {"max_steps": 2, "log_interval": 1, "eval_batches": 1, "progress_bar": False},
}


def first_batch(config_path: Path) -> dict[str, torch.Tensor]:
    """The first micro-batch a one-process run of `config_path` trains on, read as the run reads it."""
    config = load_config(config_path, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    loader = make_train_loader(
        bundle.train,
        micro_batch_size=config.document["train_micro_batch_size_per_gpu"],
        grad_accum=config.document["gradient_accumulation_steps"],
        dp_rank=0,
        dp_size=1,
        seed=config.trainer.seed,
    )
    return next(loader)


def test_a_run_from_a_pretrained_directory_starts_from_its_model(tmp_path: Path):
    directory = write_tiny_llama(tmp_path / "pretrained")
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**CONFIG, "model": {**CONFIG["model"], "init_from": str(directory)}}))
    result = run_single(str(config_path), {}, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    saved = json.loads((directory / "config.json").read_text())
    resolved = json.loads((tmp_path / "run" / "resolved_config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_key_value_heads", "intermediate_size", "vocab_size")
    assert {key: resolved["model"][key] for key in keys} == {key: saved[key] for key in keys}
    assert resolved["data"]["tokenizer"] == str(directory)

    batch = first_batch(config_path)
    torch.set_num_threads(resolved["trainer"]["threads_per_rank"])
    model = LlamaForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"]
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).item()
    first_loss = read_run(tmp_path / "run").losses[0]
    assert abs(first_loss - expected) <= LOSS_TOLERANCE, (first_loss, expected)
