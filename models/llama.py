"""Llama family: transformers' `LlamaForCausalLM` as shipped (rotary positions, RMSNorm, SwiGLU MLP,
grouped-query attention, tied or untied head), and what the engine needs around it. The same
decoder with biased query/key/value projections is transformers' `Qwen2ForCausalLM`, with an
optional sliding attention window its `MistralForCausalLM`: `model.architecture` builds either of
those classes instead, unforked, from the same fields.

This module builds, trains, exports and costs the model; what checking a config needs of the family
(presets, schema, checks, parallel plans) is models/llama_spec.py, which imports no torch. As in
models/gpt.py, transformers and DeepSpeed are imported inside the functions that build or run a
model, so the planner reads the costs here without importing them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models import decoder_pipeline, loss
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
from models.decoder_section import settled_vocabulary
from models.hf_checkpoint import HFCheckpoint
from models.kernels import apply_kernels
from models.llama_spec import (
    ARCHITECTURES,
    BUILT_AS,
    CLASSES,
    DEFAULT_ARCHITECTURE,
    HEAD_DIM_ARCHITECTURES,
    TENSOR_PARALLEL_PLAN,
    architecture,
)
from models.parallelize import parallelize_decoder
from models.presets import setting
from models.tiling import apply_tiling

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedConfig


# Built (by transformers partitioned under ZeRO-3: engine/parallel/zero3_init.py), loaded from
# `model.init_from` and exported as HF's checkpoints of the architecture: a tied embedding stored
# once, as Llama 3.2's are, an untied head under lm_head.weight.
CHECKPOINTS: Mapping[str, HFCheckpoint] = {
    name: HFCheckpoint(
        model_class=model_class,
        kind=kind,
        config=lambda section: llama_config(architecture(section)),
        fields=fields,
        fixed=(*(("head_dim",) if name in HEAD_DIM_ARCHITECTURES else ()), *BUILT_AS[name]),
        embedding="model.embed_tokens.weight",
    )
    for name, (_, model_class, kind, fields) in CLASSES.items()
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


def load_export(path: Path) -> nn.Module:
    """The exported model, as the class its config.json's model_type names."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(path, local_files_only=True).model_type
    if model_type not in CHECKPOINTS:
        raise ValueError(f"{path} holds a {model_type!r} checkpoint, not one of {', '.join(ARCHITECTURES)}")
    return CHECKPOINTS[model_type].load_export(path)


# Loss and evaluation are the causal-LM ones (models/loss.py).
compute_loss, eval_sums, summarize_eval = loss.compute_loss, loss.eval_sums, loss.summarize_eval


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
    return getattr(transformers, CLASSES[name][0])(
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


# -- FLOPs and the planner's estimates ---------------------------------------------------------


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


# Checkpointing, adapters, tensor parallelism, compile and wrapping: the decoders' (models/parallelize.py).
parallelize = functools.partial(parallelize_decoder, tensor_parallel=TENSOR_PARALLEL_PLAN, blocks=shard_units)


# A stage's batch, loss and evaluation sums: the causal-LM ones (models/decoder_pipeline.py).
pipeline_batch, pipeline_loss = decoder_pipeline.pipeline_batch, decoder_pipeline.pipeline_loss
pipeline_eval_sums = decoder_pipeline.pipeline_eval_sums
