"""GPT-2 family: transformers' `GPT2LMHeadModel` as shipped, and what the engine needs around it."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, GPT2Config, GPT2LMHeadModel

from models.common import AUTO, check_state_dict, merge_preset, setting

GPT2_VOCAB_SIZE = 50257
_GPT2_CONTEXT = {"n_positions": 1024, "vocab_size": GPT2_VOCAB_SIZE}

PRESETS: Mapping[str, Mapping[str, Any]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 64, "vocab_size": AUTO},
    "124M": {"n_layer": 12, "n_head": 12, "n_embd": 768, **_GPT2_CONTEXT},
    "350M": {"n_layer": 24, "n_head": 16, "n_embd": 1024, **_GPT2_CONTEXT},
    "774M": {"n_layer": 36, "n_head": 20, "n_embd": 1280, **_GPT2_CONTEXT},
    "1.5B": {"n_layer": 48, "n_head": 25, "n_embd": 1600, **_GPT2_CONTEXT},
}
ARCHITECTURE_FIELDS = ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")

_EMBEDDING_KEY = "transformer.wte.weight"
_HEAD_KEY = "lm_head.weight"
# math.exp overflows above this; a diverged run should report an infinite perplexity, not crash.
_LARGEST_EXP_ARGUMENT = math.log(sys.float_info.max)


def architecture(section: Mapping[str, Any]) -> dict[str, Any]:
    """The preset with the section's overrides, plus dropout and attention kernel.

    `vocab_size` may stay "auto": only the engine knows the tokenizer, and it settles the value
    before calling `build`.
    """
    return {
        **merge_preset("gpt", PRESETS, section),
        "dropout": setting(section, "dropout", 0.0),
        "attn_implementation": setting(section, "attn_implementation", "sdpa"),
    }


def gpt2_config(arch: Mapping[str, Any]) -> GPT2Config:
    vocab_size = arch["vocab_size"]
    if not isinstance(vocab_size, int):
        raise ValueError(
            f'model.vocab_size is {vocab_size!r}; the engine must replace "auto" with the tokenizer\'s '
            "vocabulary size before building the model"
        )
    # GPT-2's <|endoftext|> is id 50256; a byte or character vocabulary needs its own id in range,
    # or generation and transformers' config checks point outside the embedding table.
    special_token_id = min(GPT2_VOCAB_SIZE, vocab_size) - 1
    dropout = arch["dropout"]
    return GPT2Config(
        n_layer=arch["n_layer"],
        n_head=arch["n_head"],
        n_embd=arch["n_embd"],
        n_positions=arch["n_positions"],
        vocab_size=vocab_size,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=special_token_id,
        eos_token_id=special_token_id,
        tie_word_embeddings=True,
        attn_implementation=arch["attn_implementation"],
    )


def build(section: Mapping[str, Any]) -> GPT2LMHeadModel:
    """A training-mode model; the caller seeds the RNG, so every rank initialises the same weights."""
    config = gpt2_config(architecture(section))
    init_from = section.get("init_from")
    model = GPT2LMHeadModel(config) if init_from is None else load_pretrained(Path(init_from), config)
    if section.get("activation_checkpointing", False):
        apply_activation_checkpointing(model)
    return model


def load_pretrained(path: Path, config: GPT2Config) -> GPT2LMHeadModel:
    """Weights from a local HF checkpoint, with the configured dropout and attention kernel.

    A checkpoint of another shape is refused up front: transformers would load it anyway, leave
    the missing blocks freshly initialised and only log that it did.
    """
    saved = AutoConfig.from_pretrained(path, local_files_only=True)
    if not isinstance(saved, GPT2Config):
        raise ValueError(f"model.init_from {path} holds a {saved.model_type!r} checkpoint, not a GPT-2 one")
    differences = [
        f"{field} {getattr(saved, field)} (configured: {getattr(config, field)})"
        for field in ARCHITECTURE_FIELDS
        if getattr(saved, field) != getattr(config, field)
    ]
    if differences:
        raise ValueError(
            f"model.init_from {path} has a different architecture: {', '.join(differences)}; "
            "set these fields in the model section to match the checkpoint"
        )
    model, loading_info = GPT2LMHeadModel.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    absent = sorted(loading_info["missing_keys"]) + sorted(map(str, loading_info["mismatched_keys"]))
    if absent:
        raise ValueError(f"model.init_from {path} lacks weights the model needs: {', '.join(absent[:5])}")
    return model.train()


def apply_activation_checkpointing(model: GPT2LMHeadModel) -> None:
    """Recompute each transformer block in the backward pass instead of keeping its activations.

    Non-reentrant checkpointing works with inputs that do not require grad (token ids) and with
    DeepSpeed's ZeRO hooks; transformers wraps the blocks without renaming any parameter.
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def compute_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss; the labels are the inputs because the model shifts them itself."""
    input_ids = batch["input_ids"]
    # No KV cache: training never decodes, and the cache would cost memory on every forward.
    return model(input_ids=input_ids, labels=input_ids, use_cache=False).loss


def eval_sums(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed token loss and the tokens predicted, so the mean over every rank's batches is exact."""
    input_ids = batch["input_ids"]
    loss = compute_loss(model, batch).detach()
    # The last position of each row has no next token to predict.
    predicted = input_ids.shape[0] * (input_ids.shape[1] - 1)
    return {
        "loss_sum": loss.double() * predicted,
        "tokens": torch.tensor(predicted, dtype=torch.float64, device=loss.device),
    }


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
    loss = sums["loss_sum"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss) if loss <= _LARGEST_EXP_ARGUMENT else math.inf}


def export(state_dict: Mapping[str, torch.Tensor], section: Mapping[str, Any], out_dir: Path) -> None:
    """An HF checkpoint directory that plain `GPT2LMHeadModel.from_pretrained` loads."""
    config = gpt2_config(architecture(section))
    # Only the config and the parameter names of this model are used; the weights are `state_dict`.
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    weights = _one_embedding_key(state_dict)
    check_state_dict({key: value for key, value in model.state_dict().items() if key != _HEAD_KEY}, weights)
    model.save_pretrained(out_dir, state_dict=weights)


def load_export(path: Path) -> GPT2LMHeadModel:
    """The exported model, in eval mode as `from_pretrained` returns it."""
    return GPT2LMHeadModel.from_pretrained(path, local_files_only=True)


def _one_embedding_key(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Store the tied embedding once, under `transformer.wte.weight`.

    Consolidated checkpoints name the tied tensor under either key or both. HF's own GPT-2
    checkpoints hold only the embedding, which every version of transformers loads and re-ties.
    """
    weights = dict(state_dict)
    head = weights.pop(_HEAD_KEY, None)
    if head is None:
        return weights
    embedding = weights.setdefault(_EMBEDDING_KEY, head)
    if embedding is not head and not torch.equal(embedding, head):
        raise ValueError(f"{_EMBEDDING_KEY} and {_HEAD_KEY} differ, but the model ties them into one tensor")
    return weights
