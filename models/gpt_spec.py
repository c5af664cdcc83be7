"""The GPT family as checking a config sees it: presets, the model section's schema and checks, the
architecture and the sizes settled from it, what the family trains on and the parallel forms it has.

`python -m engine validate` (every launch's pre-flight) reads only this module of the family, so it
imports neither torch nor transformers; building, training, exporting and costing a model is
models/gpt.py, which the registry (models/registry.py) imports at the first call that needs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from models import decoder_section
from models.decoder_section import TOKEN_DATA_TYPES, decoder_architecture, decoder_schema, sequence_issues
from models.hf_config import pretrained_values, refuse_unbuildable
from models.presets import AUTO
from parallelism.tensor_plan import TensorParallelPlan

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

# What this family always builds the same way, by GPT2Config's names: a `model.init_from` checkpoint
# holding another value (a wider MLP, another activation, an untied head) is refused.
BUILT_AS: Mapping[str, Any] = {
    "n_inner": None,
    "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "tie_word_embeddings": True,
}

# The model section's own keys, as JSON Schema (engine/config/schema.py adds the keys every family has).
MODEL_SCHEMA: Mapping[str, Mapping[str, Any]] = {
    "preset": {
        "enum": list(PRESETS),
        "description": "GPT-2 size; explicit fields below override it. Beside model.init_from it gives way: the "
        "directory's config.json decides every field.",
    },
    "n_layer": {"type": "integer", "minimum": 1, "description": "Transformer blocks (overrides the preset)."},
    "n_head": {
        "type": "integer",
        "minimum": 1,
        "description": "Attention heads; must divide n_embd (overrides the preset).",
    },
    "n_embd": {"type": "integer", "minimum": 1, "description": "Model width (overrides the preset)."},
    "n_positions": {
        "type": "integer",
        "minimum": 1,
        "description": "Longest sequence the position table covers (overrides the preset).",
    },
    **decoder_schema(
        "The GPT-2 presets' parameter counts assume GPT-2's 50257 tokens: with another tokenizer, set 50257 (or "
        "50304, padded as nanoGPT pads it) for a model of the preset's size.",
        "Dropout on embeddings, attention and residuals.",
    ),
}

DATA_TYPES, SAMPLES, THROUGHPUT_KEY = TOKEN_DATA_TYPES, "tokens", "tokens_per_s"

USES_VOCABULARY = SUGGESTS_CHECKPOINTING = True


def architecture(section: Mapping[str, Any]) -> dict[str, Any]:
    return decoder_architecture("gpt", PRESETS, section)


def hidden_size(arch: Mapping[str, Any]) -> int:
    return arch["n_embd"]


def context_length(arch: Mapping[str, Any]) -> int:
    return arch["n_positions"]


# transformers builds this family partitioned under ZeRO-3 (engine/parallel/zero3_init.py).
BUILDS_PARTITIONED = True

# model.lora: peft adapts its linear layers (models/lora.py).
LORA = True

# parallel.sequence_parallel_size does not apply (tried: the first forward fails inside GPT2Attention).
SEQUENCE_PARALLEL = False

NO_SEQUENCE_PARALLEL = (
    "transformers' GPT-2 attention reshapes what the attention function returns as (batch, tokens, heads, head "
    "width), and DeepSpeed's Ulysses returns it with the heads already merged (batch, tokens, width); train a "
    'Llama-architecture model (model.family "llama") for long sequences'
)


def pretrained_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The model-section fields a GPT-2 checkpoint's config.json (`saved`) decides, read without
    importing transformers; ValueError naming what this family cannot build from it."""
    if saved.get("model_type") != "gpt2":
        raise ValueError(f"holds a {saved.get('model_type')!r} checkpoint, not a GPT-2 one")
    refuse_unbuildable(saved, BUILT_AS)
    return pretrained_values(saved, ARCHITECTURE_FIELDS)


# -- Config checks ----------------------------------------------------------------------------


def config_issues(
    section: Mapping[str, Any], data: Mapping[str, Any], micro_batch: int | None
) -> Iterator[tuple[str, str]]:
    """What the schema cannot say about a GPT config: (JSON path, how to fix it) pairs."""
    arch = architecture(section)
    if arch["n_embd"] % arch["n_head"]:
        yield (
            "model.n_head",
            f"{arch['n_head']} heads do not divide n_embd {arch['n_embd']}; pick a head count that divides the width",
        )
    yield from sequence_issues(data, arch["n_positions"], "n_positions")


def items_per_sample(data: Mapping[str, Any]) -> int:
    """Throughput and MFU count tokens: a sample holds `data.seq_len` of them."""
    return data["seq_len"]


# -- Parallel forms, as the config checks see them ----------------------------------------------

TENSOR_PARALLEL_PLAN = TensorParallelPlan(
    # q, k and v sit side by side in c_attn; each is split on head boundaries.
    column={"transformer.h.*.attn.c_attn": 3, "transformer.h.*.mlp.c_fc": 1},
    row=("transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"),
    vocab_embedding="transformer.wte",
    head="lm_head",
    # GPT2Attention splits c_attn's output by split_size and counts num_heads: per rank, a share.
    per_rank_attributes={"transformer.h.*.attn": ("num_heads", "split_size", "embed_dim")},
    divisible={"n_head": "heads"},
)

PIPELINE_BLOCK_TYPE = "GPT2Block"  # matched by search: the layer class is GPT2BlockPipe


def pipeline_blocks(arch: Mapping[str, Any]) -> int:
    return arch["n_layer"]


# What its evaluation adds up: the causal-LM sums (models/loss.py), by the name the registry reads.
EVAL_SUMS = decoder_section.EVAL_SUMS
