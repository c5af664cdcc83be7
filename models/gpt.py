"""GPT-2 family: transformers' `GPT2LMHeadModel` as shipped, and what the engine needs around it to
build, train, export and cost it. What checking a config needs of the family (presets, schema,
checks, parallel plans) is models/gpt_spec.py, which imports no torch.

transformers and DeepSpeed are imported inside the functions that build or run a model: the planner
reads the costs here and would otherwise spend most of its time importing them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
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
from models.gpt_spec import ARCHITECTURE_FIELDS, BUILT_AS, GPT2_VOCAB_SIZE, TENSOR_PARALLEL_PLAN, architecture
from models.hf_checkpoint import HFCheckpoint
from models.parallelize import parallelize_decoder
from models.tiling import apply_tiling

if TYPE_CHECKING:
    from transformers import GPT2Config, GPT2LMHeadModel


def gpt2_config(arch: Mapping[str, Any]) -> GPT2Config:
    from transformers import GPT2Config

    vocab_size = settled_vocabulary(arch)
    # GPT-2's <|endoftext|> (id 50256) ends generation only in a vocabulary that holds it. In a
    # character or byte vocabulary every id is a real character, which would stop `generate` mid-text
    # wherever it was sampled, so there the exported model names no end token at all.
    end_of_text = GPT2_VOCAB_SIZE - 1 if vocab_size >= GPT2_VOCAB_SIZE else None
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
        bos_token_id=end_of_text,
        eos_token_id=end_of_text,
        tie_word_embeddings=True,
        attn_implementation=transformers_attention(arch["attn_implementation"]),
    )


# Built, loaded from `model.init_from` and exported as HF's GPT-2 checkpoints: the tied embedding
# stored once, under transformer.wte.weight (every version of transformers loads and re-ties it).
_WTE = "transformer.wte.weight"
CHECKPOINT = HFCheckpoint(
    "GPT2LMHeadModel",
    "GPT-2",
    lambda section: gpt2_config(architecture(section)),
    ARCHITECTURE_FIELDS,
    tuple(BUILT_AS),
    _WTE,
)
check_init_from = CHECKPOINT.check_init_from


def build(section: Mapping[str, Any]) -> nn.Module:
    model = CHECKPOINT.build(section)
    apply_tiling(model, section)
    return model


export, load_export = CHECKPOINT.export, CHECKPOINT.load_export


# Loss and evaluation are the causal-LM ones (models/loss.py).
compute_loss, eval_sums, summarize_eval = loss.compute_loss, loss.eval_sums, loss.summarize_eval


# -- FLOPs and the planner's estimates ---------------------------------------------------------


def flop_parameters(n_layer: int, n_embd: int, vocab_size: int) -> int:
    """N of the "6N" term: GPT-2's parameters without the position table, from its shape.

    The position table is a lookup, no matmul, so it is left out; the token table is counted once, as
    the weight of the tied logits matmul. Biases and LayerNorms stay in, as nanoGPT's `get_num_params()`
    keeps them (0.1% of GPT-2 124M), so the figures compare with nanoGPT's. Computed from the shape,
    not counted on the model: under ZeRO-3, tensor or pipeline parallelism a rank holds only a shard.
    """
    per_layer = (
        (n_embd * 3 * n_embd + 3 * n_embd)  # query, key and value projection
        + (n_embd * n_embd + n_embd)  # attention output projection
        + (n_embd * 4 * n_embd + 4 * n_embd)  # MLP up projection
        + (4 * n_embd * n_embd + n_embd)  # MLP down projection
        + 2 * 2 * n_embd  # two LayerNorms, weight and bias
    )
    final_norm = 2 * n_embd
    return n_layer * per_layer + final_norm + vocab_size * n_embd


def flops_per_token(n_layer: int, n_embd: int, vocab_size: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N plus attention, as nanoGPT's `estimate_mfu` and PaLM appendix B.

    Attention's scores and weighted sum are matmuls without weights, seq_len * n_embd multiply-adds
    each per layer and token: 12 * n_layer * n_embd * seq_len for training. The causal mask's unused
    half is counted, as PaLM and Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473) count it.
    `seq_len` is the length trained on (`data.seq_len`), not `n_positions`.
    """
    n_params = flop_parameters(n_layer, n_embd, vocab_size)
    attention = FLOPS_PER_MAC * TRAINING_PASSES * 2 * n_layer * n_embd * seq_len
    return FLOPS_PER_MAC * TRAINING_PASSES * n_params + attention


def flops_per_item(arch: Mapping[str, Any], data: Mapping[str, Any]) -> int:
    """Training FLOPs per token at the trained sequence length; `arch` has its vocabulary settled."""
    return flops_per_token(arch["n_layer"], arch["n_embd"], arch["vocab_size"], data["seq_len"])


def plan_activations(shape: PlanShape) -> ActivationEstimate:
    """Activations by formula: what transformers' GPT2Block saves for backward (walked in its autograd
    graph on CPU), in Korthikanti et al.'s units (arXiv:2205.05198: 2-byte elements per token of
    width h) at tensor-parallel degree t. Kept whole: the two LayerNorms' inputs and outputs (8), and
    with dropout the two residual dropout masks (4, in the activations' dtype as CPU's dropout keeps
    them). Split: the query, key and value and SDPA's output, which is the output projection's input
    (8/t), and the MLP's part, which model.tiled_mlp holds for one piece at a time: GPT-2's tanh GELU
    ("gelu_new", written out in PyTorch) keeps five tensors as wide as the MLP, one of them the down
    projection's input (40/t). The attention scores only where the attention keeps them
    (`keeps_scores`): the softmax, and with dropout its mask and output (2 or 6 * a*s/(h*t)). The
    attention module's part, which attention-only recompute drops but for its input, is that input
    (2), its dropout mask, the query, key, value and output (8/t) and any scores."""
    arch = architecture(shape.section)
    hidden, heads, seq_len = arch["n_embd"], arch["n_head"], shape.data["seq_len"]
    dropout = arch["dropout"] > 0
    scores = (6 if dropout else 2) * heads * seq_len / hidden if keeps_scores(arch) else 0
    masks = 2 if dropout else 0

    def layer_factor(tensor: int) -> float:
        return 8 + 2 * masks + (8 + 40 + scores) / tensor

    def mlp_factor(tensor: int) -> float:
        return 40 / tensor

    def attention_factor(tensor: int) -> float:
        return 2 + masks + (8 + scores) / tensor

    # Ulysses moves the query, key, value and attention output, each as wide as the model.
    # The final LayerNorm keeps its input and output (the head's input).
    return decoder_activations(
        shape, hidden, shape.section.get("vocab_size"), layer_factor, mlp_factor, 4 * hidden, attention_factor, 4
    )


# -- Parallel forms ---------------------------------------------------------------------------


def shard_units(model: GPT2LMHeadModel) -> list[nn.Module]:
    """The modules FSDP shards as one unit each: the transformer blocks (the rest goes with the root)."""
    return list(model.transformer.h)


# Checkpointing, adapters, tensor parallelism, compile and wrapping: the decoders' (models/parallelize.py).
parallelize = functools.partial(parallelize_decoder, tensor_parallel=TENSOR_PARALLEL_PLAN, blocks=shard_units)


class _PositionEmbedding(nn.Module):
    """Adds position vectors and applies embedding dropout, in GPT2Model's order."""

    def __init__(self, wpe: nn.Embedding, drop: nn.Dropout):
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        return self.drop(inputs_embeds + self.wpe(positions))


class GPT2BlockPipe(nn.Module):
    """A GPT2Block as a pipeline layer: hidden states in, hidden states out, with the causal mask
    GPT2Model would have built for it (None under SDPA, which masks causally itself)."""

    def __init__(self, block: nn.Module, config: GPT2Config):
        super().__init__()
        self.block, self.config = block, config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        _, mask = positions_and_mask(self.config, hidden)
        return self.block(hidden, None, mask)


def pipeline_layers(model: GPT2LMHeadModel) -> list:
    """GPT-2 as a sequence of pipeline layers made of the model's own modules: token embedding
    (tied to the head, so DeepSpeed keeps the two copies equal across stages), positions, the
    blocks, the final norm and the head."""
    transformer = model.transformer
    embedding, head = tied_embedding_layers("wte", transformer.wte)
    return [
        embedding,
        _PositionEmbedding(transformer.wpe, transformer.drop),
        *(GPT2BlockPipe(block, model.config) for block in transformer.h),
        transformer.ln_f,
        head,
    ]


# A stage's batch, loss and evaluation sums: the causal-LM ones (models/decoder_pipeline.py).
pipeline_batch, pipeline_loss = decoder_pipeline.pipeline_batch, decoder_pipeline.pipeline_loss
pipeline_eval_sums = decoder_pipeline.pipeline_eval_sums
