"""The Llama family (Llama, Qwen2 and Mistral decoders) as checking a config sees it: presets, the
model section's schema and checks, the architecture and the sizes settled from it, what a
`model.init_from` checkpoint's config.json decides, and the parallel forms it has.

`python -m engine validate` (every launch's pre-flight) reads only this module of the family, so it
imports neither torch nor transformers; building, training, exporting and costing a model is
models/llama.py, which the registry (models/registry.py) imports at the first call that needs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from models import decoder_section
from models.decoder_section import TOKEN_DATA_TYPES, decoder_architecture, decoder_schema, sequence_issues
from models.hf_config import pretrained_values, refuse_unbuildable
from models.presets import AUTO, setting
from parallelism.tensor_plan import TensorParallelPlan

_LLAMA3 = {"vocab_size": 128256, "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}

PRESETS: Mapping[str, Mapping[str, Any]] = {
    "tiny": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "vocab_size": AUTO,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # meta-llama/Llama-3.2-1B's config.json.
    "1B": {
        **_LLAMA3,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
    },
    # meta-llama/Meta-Llama-3-8B's config.json.
    "8B": {
        **_LLAMA3,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "rope_scaling": None,
        "tie_word_embeddings": False,
    },
}

# What `model.init_from` must match, by LlamaConfig's names (rope_theta and rope_scaling make up
# its `rope_parameters`).
ARCHITECTURE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
)

# What each architecture always builds the same way, by its config class's names: a checkpoint
# holding another value is refused. Llama's and Mistral's head_dim is always hidden_size / heads.
BUILT_AS: Mapping[str, Mapping[str, Any]] = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "qwen2": {"hidden_act": "silu", "use_sliding_window": False},
    "mistral": {"hidden_act": "silu"},
}

HEAD_DIM_ARCHITECTURES = ("llama", "mistral")

# What a config.json may leave out, as each config class defaults it (tests/unit/test_init_from.py
# compares them); num_key_value_heads None is num_attention_heads (plain multi-head attention).
_SHARED_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}

PRETRAINED_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "llama": {**_SHARED_DEFAULTS, "num_key_value_heads": None},
    "qwen2": {**_SHARED_DEFAULTS, "num_key_value_heads": 32},
    "mistral": {**_SHARED_DEFAULTS, "num_key_value_heads": 8, "sliding_window": 4096},
}

# transformers keeps the context a scaled rotary embedding was pretrained at beside its parameters.
_ROPE_TYPES_WITH_ORIGINAL_CONTEXT = ("llama3", "yarn", "longrope")

# `model.architecture`: the transformers classes built, by their model_type, which is what
# `model.init_from` must hold and what an export's config.json names. Qwen2 always biases q, k and
# v and has no head_dim field; this family builds it without sliding windows (use_sliding_window
# false, as Qwen2's released checkpoints are). Mistral's window is `model.sliding_window`.
ARCHITECTURES = ("llama", "qwen2", "mistral")

DEFAULT_ARCHITECTURE = "llama"

CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "Llama", ARCHITECTURE_FIELDS),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2", ARCHITECTURE_FIELDS),
    "mistral": ("MistralConfig", "MistralForCausalLM", "Mistral", (*ARCHITECTURE_FIELDS, "sliding_window")),
}

# transformers builds this family partitioned under ZeRO-3 (engine/parallel/zero3_init.py).
BUILDS_PARTITIONED = True

# model.lora: peft adapts its linear layers (models/lora.py).
LORA = True

# parallel.sequence_parallel_size: DeepSpeed's Ulysses wraps its attention (engine/parallel/sequence.py),
# splitting the query heads and the key/value heads of grouped-query attention across the group.
SEQUENCE_PARALLEL = True

ATTENTION_HEADS = ("num_attention_heads", "num_key_value_heads")


def pretrained_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The model-section fields a checkpoint's config.json (`saved`) decides, read as transformers
    reads them (a key left out takes the config class's default; rope_theta and rope_scaling from
    transformers 5's `rope_parameters` or their older top-level keys), without importing it.
    ValueError naming what this family cannot build from it."""
    name = saved.get("model_type")
    if name not in CLASSES:
        raise ValueError(f"holds a {name!r} checkpoint, not a Llama one ({', '.join(ARCHITECTURES)})")
    fields = pretrained_values(
        saved,
        (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "vocab_size",
        ),
    )
    width = fields["hidden_size"] // fields["num_attention_heads"]
    head_dim = {"head_dim": width} if name in HEAD_DIM_ARCHITECTURES else {}
    refuse_unbuildable({**saved, "head_dim": saved.get("head_dim") or width}, {**head_dim, **BUILT_AS[name]})
    defaults = PRETRAINED_DEFAULTS[name]

    def given(key: str) -> Any:
        return saved.get(key, defaults[key])

    fields |= {
        "architecture": name,
        "num_key_value_heads": given("num_key_value_heads") or fields["num_attention_heads"],
        "rms_norm_eps": given("rms_norm_eps"),
        "tie_word_embeddings": given("tie_word_embeddings"),
        **_pretrained_rope(saved, given("rope_theta"), fields["max_position_embeddings"]),
    }
    if name == "mistral":
        fields["sliding_window"] = given("sliding_window")
    return fields


def _pretrained_rope(saved: Mapping[str, Any], theta: float, context: int) -> dict[str, Any]:
    """rope_theta and rope_scaling as transformers' `standardize_rope_params` settles them (`theta`
    the top-level rope_theta, or its default); plain RoPE is {"rope_type": "default"}, not null,
    which would leave a preset's scaling in place."""
    scaling = dict(saved.get("rope_parameters") or saved.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", theta)
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    if scaling["rope_type"] in _ROPE_TYPES_WITH_ORIGINAL_CONTEXT:
        scaling.setdefault("original_max_position_embeddings", context)
    return {"rope_theta": theta, "rope_scaling": scaling}


# Trained on token samples, `data.seq_len` of them each; the vocabulary comes from the tokenizer.
DATA_TYPES, SAMPLES, THROUGHPUT_KEY = TOKEN_DATA_TYPES, "tokens", "tokens_per_s"

USES_VOCABULARY = SUGGESTS_CHECKPOINTING = True


def _integer(description: str) -> dict[str, Any]:
    return {"type": "integer", "minimum": 1, "description": f"{description} (overrides the preset)."}


def _positive(description: str) -> dict[str, Any]:
    return {"type": "number", "exclusiveMinimum": 0, "description": f"{description} (overrides the preset)."}


# The model section's own keys, as JSON Schema (engine/config/schema.py adds the keys every family has).
MODEL_SCHEMA: Mapping[str, Mapping[str, Any]] = {
    "architecture": {
        "enum": list(ARCHITECTURES),
        "default": DEFAULT_ARCHITECTURE,
        "description": "transformers class built from these fields, unforked: llama (LlamaForCausalLM), qwen2 "
        "(Qwen2ForCausalLM: biased query/key/value projections, no sliding window), mistral "
        "(MistralForCausalLM: model.sliding_window). Exports and model.init_from checkpoints are of that "
        "model_type.",
    },
    "preset": {
        "enum": list(PRESETS),
        "description": "Llama shape: tiny (tests), 1B (Llama 3.2 1B), 8B (Llama 3 8B); explicit fields below "
        "override it. Beside model.init_from it gives way: the directory's config.json decides every field.",
    },
    "hidden_size": _integer("Model width"),
    "num_hidden_layers": _integer("Decoder layers"),
    "num_attention_heads": _integer("Query heads; must divide hidden_size into an even head width"),
    "num_key_value_heads": _integer(
        "Key/value heads (grouped-query attention); must divide num_attention_heads, which it equals for "
        "plain multi-head attention"
    ),
    "intermediate_size": _integer("Width of the SwiGLU MLP"),
    "max_position_embeddings": _integer('Longest sequence the model is meant for; data.seq_len "auto" takes it'),
    "rope_theta": _positive("Base of the rotary position embedding's frequencies"),
    "rope_scaling": {
        "type": ["object", "null"],
        "description": "transformers' rope_parameters besides rope_theta, for a scaled rotary embedding "
        '(Llama 3.1/3.2: {"rope_type": "llama3", "factor": 32.0, ...}); null: plain RoPE (overrides the preset '
        'where set; {"rope_type": "default"} turns a preset\'s scaling off).',
    },
    "rms_norm_eps": _positive("Epsilon of the RMSNorms"),
    "tie_word_embeddings": {
        "type": "boolean",
        "description": "Share one matrix between the token embedding and the output head (overrides the preset).",
    },
    "sliding_window": {
        "type": ["integer", "null"],
        "minimum": 1,
        "description": "Mistral only: MistralConfig's sliding_window, the most tokens each attends back over; "
        "null (the default): full causal attention. Must be at least data.seq_len: the pipeline layers mask "
        "causally over the whole sequence, so a shorter window would train a different model.",
    },
    "kernels": {
        "enum": ["none", "liger"],
        "description": '"liger": Liger-Kernel\'s fused Triton kernels for RMSNorm, the SwiGLU MLP and the rotary '
        "embedding in place of transformers' (picked by the architecture: Llama, Qwen2, Mistral), on CUDA with "
        "liger-kernel installed (optional: `pip install liger-kernel`); refused on CPU. The loss is model.loss's: "
        '"fused" is Liger\'s fused linear cross-entropy there.',
        "default": "none",
    },
    **decoder_schema(
        "The 1B and 8B presets assume Llama 3's 128256 tokens; the head splits as the embedding does.",
        "Dropout on the attention weights (Llama's only dropout, attention_dropout).",
    ),
}


def architecture(section: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **decoder_architecture("llama", PRESETS, section),
        "architecture": setting(section, "architecture", DEFAULT_ARCHITECTURE),
        "sliding_window": section.get("sliding_window"),
    }


# -- Config checks ----------------------------------------------------------------------------


def config_issues(
    section: Mapping[str, Any], data: Mapping[str, Any], micro_batch: int | None
) -> Iterator[tuple[str, str]]:
    """What the schema cannot say about a Llama config: (JSON path, how to fix it) pairs. The
    tensor-parallel degree's divisibility is checked from TENSOR_PARALLEL_PLAN.divisible, the
    pipeline stages against the layers, by the engine's rules for every family."""
    arch = architecture(section)
    hidden, heads, kv_heads = arch["hidden_size"], arch["num_attention_heads"], arch["num_key_value_heads"]
    if hidden % heads:
        yield (
            "model.num_attention_heads",
            f"{heads} heads do not divide hidden_size {hidden}; pick a head count that divides the width",
        )
    elif (hidden // heads) % 2:
        yield (
            "model.num_attention_heads",
            f"{heads} heads of hidden_size {hidden} are {hidden // heads} wide; rotary embeddings rotate pairs of "
            "features, so pick a head count that leaves an even head width",
        )
    if heads % kv_heads:
        yield (
            "model.num_key_value_heads",
            f"{kv_heads} key/value heads do not divide num_attention_heads {heads}; each key/value head serves "
            "an equal group of query heads",
        )
    yield from _sliding_window_issues(arch, data)
    yield from sequence_issues(data, arch["max_position_embeddings"], "max_position_embeddings")


def _sliding_window_issues(arch: Mapping[str, Any], data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    window, name = arch["sliding_window"], arch["architecture"]
    if window is None:
        return
    if name != "mistral":
        yield (
            "model.sliding_window",
            f'model.architecture "{name}" is built without a sliding window; remove it or use "mistral"',
        )
        return
    seq_len = data.get("seq_len", AUTO)
    seq_len = arch["max_position_embeddings"] if seq_len == AUTO else seq_len
    if window < seq_len:
        yield (
            "model.sliding_window",
            f"{window} is shorter than data.seq_len {seq_len}; the engine's pipeline layers mask causally over the "
            f"whole sequence and would train a different model than MistralForCausalLM; set it to at least "
            f"{seq_len} or null",
        )


def hidden_size(arch: Mapping[str, Any]) -> int:
    """The width ZeRO's buckets are sized by."""
    return arch["hidden_size"]


def context_length(arch: Mapping[str, Any]) -> int:
    """What data.seq_len "auto" trains on."""
    return arch["max_position_embeddings"]


def items_per_sample(data: Mapping[str, Any]) -> int:
    """Throughput and MFU count tokens: a sample holds `data.seq_len` of them."""
    return data["seq_len"]


# -- Parallel forms, as the config checks see them ----------------------------------------------

_LAYER = "model.layers.*"

TENSOR_PARALLEL_PLAN = TensorParallelPlan(
    # Each projection splits on head boundaries: rank r keeps query heads r*H/t.. and the key/value
    # heads r*KV/t.. that serve exactly those query heads under grouped-query attention (Qwen2's
    # q/k/v biases split with their weights' rows: column-parallel layers shard a bias too).
    column={f"{_LAYER}.self_attn.{name}_proj": 1 for name in ("q", "k", "v")}
    | {f"{_LAYER}.mlp.gate_proj": 1, f"{_LAYER}.mlp.up_proj": 1},
    row=(f"{_LAYER}.self_attn.o_proj", f"{_LAYER}.mlp.down_proj"),
    vocab_embedding="model.embed_tokens",
    head="lm_head",
    # LlamaAttention counts no heads: it views its projections as (-1, head_dim), and the ratio of
    # query to key/value heads it repeats by (num_key_value_groups) is the same on every rank.
    per_rank_attributes={},
    divisible={
        "num_attention_heads": "attention heads",
        "num_key_value_heads": "key/value heads",
        "intermediate_size": "MLP features (intermediate_size)",
    },
)

# A regular expression searched in class names (DeepSpeed's partition "type:"): the pipeline layer
# class is LlamaDecoderLayerPipe whichever decoder layer it wraps.
PIPELINE_BLOCK_TYPE = "LlamaDecoderLayer|Qwen2DecoderLayer|MistralDecoderLayer"


def pipeline_blocks(arch: Mapping[str, Any]) -> int:
    return arch["num_hidden_layers"]


# What its evaluation adds up: the causal-LM sums (models/loss.py), by the name the registry reads.
EVAL_SUMS = decoder_section.EVAL_SUMS
