"""GPT-2 family: transformers' `GPT2LMHeadModel` as shipped, and what the engine needs around it.

transformers and DeepSpeed are imported inside the functions that build or run a model: config
validation (`python -m engine validate`, which launch.sh runs before every launch, and the planner)
reads only the presets and plans here and would otherwise spend most of its time importing them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common import AUTO, IGNORE_INDEX, check_state_dict, merge_preset, setting
from models.costs import FLOPS_PER_MAC, TRAINING_PASSES, ActivationEstimate, PlanShape
from models.tensor_parallel import TensorParallelPlan, tied_logits

if TYPE_CHECKING:
    from transformers import GPT2Config, GPT2LMHeadModel

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

# The model section's own keys, as JSON Schema (engine/config/schema.py adds the keys every family has).
MODEL_SCHEMA: Mapping[str, Mapping[str, Any]] = {
    "preset": {"enum": list(PRESETS), "description": "GPT-2 size; explicit fields below override it."},
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
    "vocab_size": {
        "anyOf": [{"type": "integer", "minimum": 1}, {"const": AUTO}],
        "description": 'Vocabulary size; "auto" (the default, taking over from the preset): the tokenizer\'s '
        "vocabulary size, rounded up to a multiple of parallel.tensor_parallel_size so the embedding splits "
        "evenly. The GPT-2 presets' parameter counts assume GPT-2's 50257 tokens: with another tokenizer, set "
        "50257 (or 50304, padded as nanoGPT pads it) for a model of the preset's size.",
    },
    "dropout": {
        "type": "number",
        "minimum": 0,
        "exclusiveMaximum": 1,
        "description": "Dropout on embeddings, attention and residuals.",
        "default": 0.0,
    },
    "attn_implementation": {
        "enum": ["sdpa", "eager"],
        "description": "Attention kernel used by transformers.",
        "default": "sdpa",
    },
}
# Trained on token samples, `data.seq_len` of them each; the vocabulary comes from the tokenizer.
DATA_TYPES = ("text", "tokens", "synthetic")
SAMPLES = "tokens"
THROUGHPUT_KEY = "tokens_per_s"
USES_VOCABULARY = True
SUGGESTS_CHECKPOINTING = True

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
    from transformers import GPT2Config

    vocab_size = arch["vocab_size"]
    if not isinstance(vocab_size, int):
        raise ValueError(
            f'model.vocab_size is {vocab_size!r}; the engine must replace "auto" with the tokenizer\'s '
            "vocabulary size before building the model"
        )
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
        attn_implementation=arch["attn_implementation"],
    )


# transformers builds this family partitioned under ZeRO-3 (engine/parallel/zero3_init.py).
BUILDS_PARTITIONED = True


def build(section: Mapping[str, Any]) -> GPT2LMHeadModel:
    """A training-mode model; the caller seeds the RNG, so every rank initialises the same weights."""
    config = gpt2_config(architecture(section))
    init_from = section.get("init_from")
    model = initialised_model(config) if init_from is None else load_pretrained(Path(init_from), config)
    if section.get("activation_checkpointing", False):
        apply_activation_checkpointing(model)
    return model


def initialised_model(config: GPT2Config) -> GPT2LMHeadModel:
    """Fresh weights, drawn only after construction, module by module in `initialize_weights`' order.

    That is the order transformers draws them in when it builds the model partitioned under ZeRO-3
    (`deepspeed.zero.Init`, then `initialize_weights_zero3`), while a plain constructor would first
    spend the RNG on torch's default initialisation: drawn this way, a ZeRO-3 run starts from the same
    weights as every other layout.
    """
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel
    from transformers.initialization import no_init_weights
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return AutoModelForCausalLM.from_config(config).train()
    with no_init_weights():
        model = GPT2LMHeadModel(config)
    model.initialize_weights()
    model.tie_weights()
    return model


def check_init_from(section: Mapping[str, Any]) -> None:
    """Refuse a `model.init_from` that is no GPT-2 checkpoint of the configured shape. Read alone,
    before any process group starts: the model itself is built after."""
    if section.get("init_from") is not None:
        _check_pretrained(Path(section["init_from"]), gpt2_config(architecture(section)))


def _check_pretrained(path: Path, config: GPT2Config) -> None:
    from transformers import AutoConfig, GPT2Config

    try:
        saved = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"model.init_from {path} is not a transformers checkpoint ({reason})") from None
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


def load_pretrained(path: Path, config: GPT2Config) -> GPT2LMHeadModel:
    """Weights from a local HF checkpoint, with the configured dropout and attention kernel.

    A checkpoint of another shape is refused up front: transformers would load it anyway, leave
    the missing blocks freshly initialised and only log that it did.
    """
    from transformers import GPT2LMHeadModel

    _check_pretrained(path, config)
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
    """Mean next-token loss over every position: the labels arrive already one token on."""
    # No KV cache: training never decodes, and the cache would cost memory on every forward.
    return pipeline_loss(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"])


def eval_sums(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed token loss and the tokens predicted, so the mean over every rank's batches is exact."""
    return pipeline_eval_sums(model(input_ids=batch["input_ids"], use_cache=False).logits, batch["labels"])


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
    loss = sums["loss_sum"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss) if loss <= _LARGEST_EXP_ARGUMENT else math.inf}


def export(state_dict: Mapping[str, torch.Tensor], section: Mapping[str, Any], out_dir: Path) -> None:
    """An HF checkpoint directory that plain `GPT2LMHeadModel.from_pretrained` loads."""
    from transformers import GPT2LMHeadModel

    config = gpt2_config(architecture(section))
    # Only the config and the parameter names of this model are used; the weights are `state_dict`.
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    weights = _one_embedding_key(state_dict)
    check_state_dict({key: value for key, value in model.state_dict().items() if key != _HEAD_KEY}, weights)
    model.save_pretrained(out_dir, state_dict=weights)


def load_export(path: Path) -> GPT2LMHeadModel:
    """The exported model, in eval mode as `from_pretrained` returns it."""
    from transformers import GPT2LMHeadModel

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


# -- Config checks, FLOPs and the planner's estimates ------------------------------------------


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
    seq_len = data.get("seq_len", AUTO)
    if seq_len != AUTO and seq_len > arch["n_positions"]:
        yield (
            "data.seq_len",
            f"{seq_len} is longer than model.n_positions {arch['n_positions']}; shorten it or raise n_positions",
        )
    vocab = arch["vocab_size"]
    if data["type"] in ("text", "tokens") and data["tokenizer"] == "byte" and vocab != AUTO and vocab < 256:
        yield "model.vocab_size", f'{vocab} is smaller than the byte tokenizer\'s 256 tokens; use 256 or "auto"'


def items_per_sample(data: Mapping[str, Any]) -> int:
    """Throughput and MFU count tokens: a sample holds `data.seq_len` of them."""
    return data["seq_len"]


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


def activation_bytes(
    arch: Mapping[str, Any],
    seq_len: int,
    micro_batch: int,
    layers: int,
    tensor: int,
    element: int,
    checkpointing: bool,
    last_stage: bool,
) -> int:
    """Activations one micro-batch leaves for backward on one rank: per transformer layer
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes at 2 bytes per element (Korthikanti et al. 2022,
    arXiv:2205.05198, eq. 2 with tensor parallelism, no sequence parallelism), scaled to the training
    dtype; with activation checkpointing only each layer's input (s*b*h elements) plus one layer
    recomputed at a time. The last stage adds the fp32 logits and their gradient."""
    hidden, heads = arch["n_embd"], arch["n_head"]
    per_layer_16bit = seq_len * micro_batch * hidden * (10 + 24 / tensor + 5 * heads * seq_len / (hidden * tensor))
    full_layer = int(per_layer_16bit * element / 2)
    if checkpointing:
        kept = layers * seq_len * micro_batch * hidden * element + (full_layer if layers else 0)
    else:
        kept = layers * full_layer
    logits = 2 * 4 * seq_len * micro_batch * arch["vocab_size"] // tensor if last_stage else 0
    return kept + logits


def plan_activations(shape: PlanShape) -> ActivationEstimate:
    """Activations by formula (`activation_bytes`); every stage boundary and tensor-parallel
    all-reduce moves one hidden state of the micro-batch's tokens."""
    arch = architecture(shape.section) | {"vocab_size": shape.section.get("vocab_size")}
    seq_len = shape.data["seq_len"]

    def stage_bytes(stage: int, blocks: int, checkpointing: bool) -> int:
        last = stage == shape.stages - 1
        return activation_bytes(
            arch, seq_len, shape.micro_batch, blocks, shape.tensor, shape.element, checkpointing, last
        )

    tokens, hidden = shape.micro_batch * seq_len, arch["n_embd"]
    return ActivationEstimate(stage_bytes, tokens, hidden, [tokens * hidden] * (shape.stages - 1))


# -- Parallel forms ---------------------------------------------------------------------------

TENSOR_PARALLEL_PLAN = TensorParallelPlan(
    # q, k and v sit side by side in c_attn; each is split on head boundaries.
    column={"transformer.h.*.attn.c_attn": 3, "transformer.h.*.mlp.c_fc": 1},
    row=("transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_proj"),
    vocab_embedding="transformer.wte",
    tied_head="lm_head",
    # GPT2Attention splits c_attn's output by split_size and counts num_heads: per rank, a share.
    per_rank_attributes={"transformer.h.*.attn": ("num_heads", "split_size", "embed_dim")},
)


def shard_units(model: GPT2LMHeadModel) -> list[nn.Module]:
    """The modules FSDP shards as one unit each: the transformer blocks (the rest goes with the root)."""
    return list(model.transformer.h)


PIPELINE_BLOCK_TYPE = "GPT2Block"  # matched by search: the layer class is GPT2BlockPipe
_TIED_EMBEDDING = "embedding"


def pipeline_blocks(arch: Mapping[str, Any]) -> int:
    return arch["n_layer"]


class _TokenEmbedding(nn.Module):
    """The tied token embedding: looked up on the first stage, the output projection on the last."""

    def __init__(self, wte: nn.Module):
        super().__init__()
        self.wte = wte

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids)


def _tied_head(embedding: _TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return tied_logits(embedding.wte, hidden)


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
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
        )
        return self.block(hidden, None, mask)


def pipeline_layers(model: GPT2LMHeadModel) -> list:
    """GPT-2 as a sequence of pipeline layers made of the model's own modules: token embedding
    (tied to the head, so DeepSpeed keeps the two copies equal across stages), positions, the
    blocks, the final norm and the head."""
    from deepspeed.pipe import TiedLayerSpec

    transformer = model.transformer
    return [
        TiedLayerSpec(_TIED_EMBEDDING, _TokenEmbedding, transformer.wte, tied_weight_attr="wte.weight"),
        _PositionEmbedding(transformer.wpe, transformer.drop),
        *(GPT2BlockPipe(block, model.config) for block in transformer.h),
        transformer.ln_f,
        TiedLayerSpec(
            _TIED_EMBEDDING, _TokenEmbedding, transformer.wte, forward_fn=_tied_head, tied_weight_attr="wte.weight"
        ),
    ]


def pipeline_batch(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(first stage's input, last stage's labels)."""
    return batch["input_ids"], batch["labels"]


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' own causal-LM loss (fp32 logits), given labels the data already shifted: a
    sample of seq_len inputs carries seq_len targets, where shifting inside would score seq_len - 1."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    # It views the labels flat, as its own shift leaves them contiguous.
    return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=labels.contiguous())


EVAL_SUMS = ("loss_sum", "tokens")


def pipeline_eval_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed in fp32 logits over the tokens that count (labels other than IGNORE_INDEX)."""
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return {"loss_sum": loss.detach().double(), "tokens": (flat != IGNORE_INDEX).sum().double()}
