"""GPT-2 family: transformers' `GPT2LMHeadModel` as shipped, and what the engine needs around it.

transformers and DeepSpeed are imported inside the functions that build or run a model: config
validation (`python -m engine validate`, which launch.sh runs before every launch, and the planner)
reads only the presets and plans here and would otherwise spend most of its time importing them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from models.common import AUTO, IGNORE_INDEX, check_state_dict, merge_preset, setting
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
