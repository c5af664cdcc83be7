"""The model-section keys, defaults and checks the causal language models (the GPT and Llama
families) share."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from models.presets import AUTO, merge_preset, setting

# Both train on token samples, `data.seq_len` of them each, with the vocabulary from the tokenizer.
TOKEN_DATA_TYPES = ("text", "tokens", "chat", "instruction", "synthetic")
# What their evaluation adds up (models/loss.eval_sums): the summed token loss and the tokens predicted.
EVAL_SUMS = ("loss_sum", "tokens")


def decoder_schema(vocabulary: str, dropout: str) -> dict[str, dict[str, Any]]:
    """The model-section keys both families have, as JSON Schema: `vocabulary` ends the vocabulary
    size's description with what the family's presets assume, `dropout` says where it applies."""
    return {
        "vocab_size": {
            "anyOf": [{"type": "integer", "minimum": 1}, {"const": AUTO}],
            "description": 'Vocabulary size; "auto" (the default, taking over from the preset): the tokenizer\'s '
            "vocabulary size, rounded up to a multiple of parallel.tensor_parallel_size so the embedding splits "
            f"evenly. {vocabulary}",
        },
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1, "description": dropout, "default": 0.0},
        "attn_implementation": {
            "enum": ["sdpa", "eager"],
            "description": "Attention kernel used by transformers.",
            "default": "sdpa",
        },
        "tiled_mlp": {
            "type": "boolean",
            "description": "Run each transformer block's MLP as DeepSpeed's TiledMLP (Arctic Long Sequence "
            "Training): over a rank's tokens in ceil(tokens / width) pieces, first without keeping anything, then "
            "again piece by piece in the backward pass. Only the MLP's input is kept; its intermediate "
            "activations (GPT: the GELU's input and output, 8 x width per token; Llama: the SwiGLU gate, its SiLU, "
            "the up projection and their product, 4 x intermediate_size per token: most of a layer's) exist for "
            "one piece of about width tokens at a time instead of the whole sequence. Costs one more MLP forward "
            "per step; for sequences much longer than the model is wide. DeepSpeed backend.",
            "default": False,
        },
        "loss": {
            "enum": ["auto", "full", "tiled", "fused"],
            "description": '"full": the model computes the logits of every position, and the loss holds them in '
            "fp32 with their gradients (about 12 bytes x vocabulary per token at its peak, gigabytes per sequence "
            'of a Llama 3 vocabulary). "tiled": as Arctic Long Sequence Training tiles it, the head and the loss '
            "piece by piece over the positions, each piece's fp32 logits at most 128 MiB and computed again in the "
            "backward pass (models/tiling.py): the same loss and gradients without the whole logits, for every "
            "head (ZeRO-3's, a vocabulary split by tensor parallelism); trainer.compile compiles it with the model "
            'on the DeepSpeed backend. "fused": the head\'s gradients computed in the forward piece by piece, '
            "nothing computed twice: Liger-Kernel's fused linear cross-entropy (Triton) on CUDA where liger-kernel "
            "is installed, the engine's PyTorch form of it elsewhere; a head split by tensor parallelism or "
            'partitioned by ZeRO-3 or FSDP takes "tiled". "auto": "fused" where a micro-batch\'s logits span more '
            'than one piece and the head is whole, "full" otherwise. Each also computes the evaluation loss. '
            'Under pipeline parallelism the last stage computes "tiled" and "fused" from its head\'s input, and '
            '"auto" is "full".',
            "default": "auto",
        },
    }


def decoder_architecture(
    family: str, presets: Mapping[str, Mapping[str, Any]], section: Mapping[str, Any]
) -> dict[str, Any]:
    """The preset with the section's overrides, plus dropout and attention kernel.

    `vocab_size` may stay "auto": only the engine knows the tokenizer, and it settles the value
    before calling `build`.
    """
    return {
        **merge_preset(family, presets, section),
        "dropout": setting(section, "dropout", 0.0),
        "attn_implementation": setting(section, "attn_implementation", "sdpa"),
    }


def settled_vocabulary(arch: Mapping[str, Any]) -> int:
    """The vocabulary size a model is built with, refused while still "auto"."""
    vocab_size = arch["vocab_size"]
    if not isinstance(vocab_size, int):
        raise ValueError(
            f'model.vocab_size is {vocab_size!r}; the engine must replace "auto" with the tokenizer\'s '
            "vocabulary size before building the model"
        )
    return vocab_size


def sequence_issues(data: Mapping[str, Any], context: int, context_field: str) -> Iterator[tuple[str, str]]:
    """A sequence longer than the model's context (`context_field`). A vocabulary the tokenizer
    overflows is the engine's rule (engine/config/rules.py), which knows which data reads a tokenizer."""
    seq_len = data.get("seq_len", AUTO)
    if seq_len != AUTO and seq_len > context:
        yield (
            "data.seq_len",
            f"{seq_len} is longer than model.{context_field} {context}; shorten it or raise {context_field}",
        )
