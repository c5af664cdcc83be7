"""Llama family: transformers' `LlamaForCausalLM` as shipped (rotary positions, RMSNorm, SwiGLU MLP,
grouped-query attention, tied or untied head), and what the engine needs around it. The same
decoder with biased query/key/value projections is transformers' `Qwen2ForCausalLM`, with an
optional sliding attention window its `MistralForCausalLM`: `model.architecture` builds either of
those classes instead, unforked, from the same fields.

As in models/gpt.py, transformers and DeepSpeed are imported inside the functions that build or run
a model, so config validation and the planner read the presets without importing them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models import checkpointing, decoder_pipeline, loss
from models.attention import transformers_attention
from models.costs import (
    FLOPS_PER_MAC,
    TRAINING_PASSES,
    ActivationEstimate,
    PlanShape,
    decoder_activations,
    keeps_scores,
)
from models.decoder_pipeline import positions_and_mask, tied_embedding_layers
from models.decoder_section import (
    TOKEN_DATA_TYPES,
    decoder_architecture,
    decoder_schema,
    sequence_issues,
    settled_vocabulary,
)
from models.hf_checkpoint import HFCheckpoint, pretrained_values, refuse_unbuildable
from models.kernels import apply_kernels
from models.presets import AUTO, setting
from models.tiling import apply_tiling
from parallelism.tensor import TensorParallelPlan

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedConfig

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
_HEAD_DIM = ("llama", "mistral")
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
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "Llama", ARCHITECTURE_FIELDS),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2", ARCHITECTURE_FIELDS),
    "mistral": ("MistralConfig", "MistralForCausalLM", "Mistral", (*ARCHITECTURE_FIELDS, "sliding_window")),
}
# Built (by transformers partitioned under ZeRO-3: engine/parallel/zero3_init.py), loaded from
# `model.init_from` and exported as HF's checkpoints of the architecture: a tied embedding stored
# once, as Llama 3.2's are, an untied head under lm_head.weight.
BUILDS_PARTITIONED = True
# model.lora: peft adapts its linear layers (models/lora.py).
LORA = True
# parallel.sequence_parallel_size: DeepSpeed's Ulysses wraps its attention (engine/parallel/sequence.py),
# splitting the query heads and the key/value heads of grouped-query attention across the group.
SEQUENCE_PARALLEL = True
ATTENTION_HEADS = ("num_attention_heads", "num_key_value_heads")
CHECKPOINTS: Mapping[str, HFCheckpoint] = {
    name: HFCheckpoint(
        model_class=model_class,
        kind=kind,
        config=lambda section: llama_config(architecture(section)),
        fields=fields,
        fixed=(*(("head_dim",) if name in _HEAD_DIM else ()), *BUILT_AS[name]),
        embedding="model.embed_tokens.weight",
    )
    for name, (_, model_class, kind, fields) in _CLASSES.items()
}


def _checkpoint(section: Mapping[str, Any]) -> HFCheckpoint:
    return CHECKPOINTS[setting(section, "architecture", DEFAULT_ARCHITECTURE)]


def build(section: Mapping[str, Any]) -> nn.Module:
    model = _checkpoint(section).build(section)
    apply_kernels(model, section)
    apply_tiling(model, section)
    return model


def check_init_from(section: Mapping[str, Any]) -> None:
    _checkpoint(section).check_init_from(section)


def export(
    state_dict: Mapping[str, torch.Tensor],
    section: Mapping[str, Any],
    out_dir: Path,
    class_names: Sequence[str] | None = None,
) -> None:
    _checkpoint(section).export(state_dict, section, out_dir, class_names)


def pretrained_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The model-section fields a checkpoint's config.json (`saved`) decides, read as transformers
    reads them (a key left out takes the config class's default; rope_theta and rope_scaling from
    transformers 5's `rope_parameters` or their older top-level keys), without importing it.
    ValueError naming what this family cannot build from it."""
    name = saved.get("model_type")
    if name not in _CLASSES:
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
    head_dim = {"head_dim": width} if name in _HEAD_DIM else {}
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


def load_export(path: Path) -> nn.Module:
    """The exported model, as the class its config.json's model_type names."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if model_type not in CHECKPOINTS:
        raise ValueError(f"{path} holds a {model_type!r} checkpoint, not one of {', '.join(ARCHITECTURES)}")
    return CHECKPOINTS[model_type].load_export(path)


# Loss, evaluation and activation checkpointing are the causal-LM ones (models/loss.py,
# models/checkpointing.py).
compute_loss, eval_sums, summarize_eval = loss.compute_loss, loss.eval_sums, loss.summarize_eval
apply_activation_checkpointing = checkpointing.apply_activation_checkpointing
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


def llama_config(arch: Mapping[str, Any]) -> PreTrainedConfig:
    """The transformers config of `arch["architecture"]` (LlamaConfig, Qwen2Config or MistralConfig)."""
    import transformers

    name = arch["architecture"]
    own = {
        "llama": {},
        "qwen2": {"use_sliding_window": False, "sliding_window": None},
        "mistral": {"sliding_window": arch["sliding_window"]},
    }[name]
    rope = {**(arch["rope_scaling"] or {"rope_type": "default"}), "rope_theta": float(arch["rope_theta"])}
    return getattr(transformers, _CLASSES[name][0])(
        **own,
        vocab_size=settled_vocabulary(arch),
        hidden_size=arch["hidden_size"],
        intermediate_size=arch["intermediate_size"],
        num_hidden_layers=arch["num_hidden_layers"],
        num_attention_heads=arch["num_attention_heads"],
        num_key_value_heads=arch["num_key_value_heads"],
        max_position_embeddings=arch["max_position_embeddings"],
        rms_norm_eps=float(arch["rms_norm_eps"]),
        tie_word_embeddings=arch["tie_word_embeddings"],
        rope_parameters=rope,
        attention_dropout=float(arch["dropout"]),
        # No special token ids: the tokenizer exported beside the model names its own, and in a
        # character vocabulary LlamaConfig's defaults (1, 2) are real characters that would stop
        # `generate` mid-text. No padding row either: nn.Embedding would never train it.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=transformers_attention(arch["attn_implementation"]),
    )


# -- Config checks, FLOPs and the planner's estimates ------------------------------------------


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


def flop_parameters(arch: Mapping[str, Any]) -> int:
    """N of the "6N" term, from the shape: every weight a matmul multiplies each token by, plus the
    RMSNorm weights (as GPT's N keeps its LayerNorms) and Qwen2's query/key/value biases. Grouped-query
    attention projects keys and values to num_key_value_heads heads only. The token embedding is a
    lookup and left out; the head is counted as the logits matmul it is, once, whether or not it
    shares the embedding's matrix (so N equals GPT's convention for a tied head and torchtitan's for
    an untied one)."""
    hidden, inner = arch["hidden_size"], arch["intermediate_size"]
    kv_width = arch["num_key_value_heads"] * (hidden // arch["num_attention_heads"])
    per_layer = (
        hidden * hidden  # query projection
        + 2 * hidden * kv_width  # key and value projections
        + hidden * hidden  # attention output projection
        + 3 * hidden * inner  # SwiGLU gate, up and down projections
        + 2 * hidden  # two RMSNorms
        + ((hidden + 2 * kv_width) if arch.get("architecture") == "qwen2" else 0)  # q/k/v biases
    )
    final_norm = hidden
    return arch["num_hidden_layers"] * per_layer + final_norm + arch["vocab_size"] * hidden


def flops_per_item(arch: Mapping[str, Any], data: Mapping[str, Any]) -> int:
    """Training FLOPs per token at the trained sequence length: 6N plus attention, as for GPT
    (models/gpt.flops_per_token). Scores and weighted sum run over every query head, so they cost
    seq_len * hidden_size multiply-adds each per layer and token, however few key/value heads there
    are. `arch` has its vocabulary settled."""
    attention = FLOPS_PER_MAC * TRAINING_PASSES * 2 * arch["num_hidden_layers"] * arch["hidden_size"] * data["seq_len"]
    return FLOPS_PER_MAC * TRAINING_PASSES * flop_parameters(arch) + attention


def plan_activations(shape: PlanShape) -> ActivationEstimate:
    """Activations by formula: what transformers' LlamaDecoderLayer saves for backward (walked in its
    autograd graph at fp32 and bf16 on CPU), in Korthikanti et al.'s units (arXiv:2205.05198: 2-byte
    elements per token of width h) at tensor-parallel degree t. Kept whole on every rank: each of the
    two RMSNorms keeps its input in fp32 (a copy under bf16), the normalised states and its output,
    which the q/k/v (or gate/up) projections share: 8 + 16 / (bytes per element). Split: the query
    (2h) and the key and value (4 * kv width) after rotation, SDPA's output, which is the output
    projection's input (2h), and the gate output, its SiLU, the up output and their product
    (8 * intermediate: the MLP's part, which model.tiled_mlp holds for one piece at a time). The
    attention scores, softmax and dropout mask (5 * heads * seq_len) only where the attention keeps
    them (`keeps_scores`). Under sequence parallelism DeepSpeed repeats each key/value head over
    SP / kv ranks where there are fewer than SP of them, so a rank's keys and values are as wide as
    max(kv, SP) heads per token of its slice. The attention module's part, which attention-only
    recompute drops but for its input, is that input (2), the query, keys, values and output, and
    any scores. `decoder_activations` scales and sums them."""
    arch = architecture(shape.section)
    hidden, heads, seq_len = arch["hidden_size"], arch["num_attention_heads"], shape.data["seq_len"]
    kv_width = max(arch["num_key_value_heads"], shape.sequence) * (hidden // heads)
    mlp = 8 * arch["intermediate_size"]
    scores = 5 * heads * seq_len if keeps_scores(arch) else 0
    whole = 8 + 16 / shape.element
    attention = 4 * hidden + 4 * kv_width + scores

    def layer_factor(tensor: int) -> float:
        return whole + (attention + mlp) / (hidden * tensor)

    def mlp_factor(tensor: int) -> float:
        return mlp / (hidden * tensor)

    def attention_factor(tensor: int) -> float:
        return 2 + attention / (hidden * tensor)

    return decoder_activations(
        shape,
        hidden,
        shape.section.get("vocab_size"),
        layer_factor,
        mlp_factor,
        2 * hidden + 2 * kv_width,
        attention_factor,
        whole / 2,  # the final RMSNorm keeps what each of a layer's two does
    )


# -- Parallel forms ---------------------------------------------------------------------------

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


class LlamaDecoderLayerPipe(nn.Module):
    """A LlamaDecoderLayer (or Qwen2's, Mistral's: the same call) as a pipeline layer: hidden states
    in, hidden states out. Only that one tensor crosses a stage boundary, so each layer makes what
    LlamaModel would have handed it: the positions of the whole sequence, their rotary cos/sin (the
    model's own rotary module, shared by every layer of a stage) and the causal mask. The mask is
    the full causal one: a Mistral sliding window shorter than the sequence is refused by
    `config_issues`."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: PreTrainedConfig):
        super().__init__()
        self.layer, self.rotary, self.config = layer, rotary, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions, mask = positions_and_mask(self.config, hidden)
        rotation = self.rotary(hidden, positions)
        return self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotation)


def pipeline_layers(model: LlamaForCausalLM) -> list:
    """Llama as a sequence of pipeline layers made of the model's own modules: token embedding,
    the decoder layers, the final norm and the head. A tied head is the embedding again (DeepSpeed
    keeps the first and last stage's copies equal); an untied one is its own layer on the last stage."""
    decoder = model.model
    layers = [LlamaDecoderLayerPipe(layer, decoder.rotary_emb, model.config) for layer in decoder.layers]
    if model.config.tie_word_embeddings:
        embedding, head = tied_embedding_layers("embed_tokens", decoder.embed_tokens)
    else:
        embedding, head = decoder.embed_tokens, model.lm_head
    return [embedding, *layers, decoder.norm, head]


def shard_units(model: LlamaForCausalLM) -> list[nn.Module]:
    """The modules FSDP shards as one unit each: the decoder layers (the rest goes with the root)."""
    return list(model.model.layers)


# A stage's batch, loss and evaluation sums: the causal-LM ones (models/decoder_pipeline.py).
pipeline_batch, pipeline_loss = decoder_pipeline.pipeline_batch, decoder_pipeline.pipeline_loss
pipeline_eval_sums, EVAL_SUMS = decoder_pipeline.pipeline_eval_sums, loss.EVAL_SUMS
