"""Helpers shared by every model family module."""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.checkpointing import EVERY_BLOCK, Checkpointing, checkpoint_forward, checkpoint_function
from models.costs import ActivationEstimate, PlanShape
from models.tensor_parallel import tied_logits

AUTO = "auto"

# The label every family's loss and evaluation skip (torch's and transformers' default): evaluation
# gives the samples it repeats to fill its batches no weight with it (data/loader.make_eval_loader).
IGNORE_INDEX = -100


def merge_preset(family: str, presets: Mapping[str, Mapping[str, Any]], section: Mapping[str, Any]) -> dict[str, Any]:
    """The preset named by `section["preset"]`, with every field the section sets (not None) taking over.

    None counts as unset so that a config can spell out a key without pinning it.
    """
    name = section.get("preset")
    if name is None:
        # Only a model.init_from directory's config.json leaves it out, having given every field
        # (engine/config/pretrained.py).
        return {key: section.get(key) for key in next(iter(presets.values()))}
    if name not in presets:
        choices = ", ".join(presets)
        raise ValueError(f"model.preset {name!r} is not a {family} preset; choose one of: {choices}")
    merged = dict(presets[name])
    for key in merged:
        if section.get(key) is not None:
            merged[key] = section[key]
    return merged


def pretrained_values(saved: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """`names` as a checkpoint's config.json (`saved`) gives them; ValueError naming those it leaves
    out, whose transformers defaults (Llama's 4096 wide, 32 layers) no small checkpoint means."""
    missing = [name for name in names if saved.get(name) is None]
    if missing:
        raise ValueError(f"gives no {', '.join(missing)} in its config.json")
    return {name: saved[name] for name in names}


def refuse_unbuildable(saved: Mapping[str, Any], built_as: Mapping[str, Any]) -> None:
    """ValueError naming each value of a checkpoint's config.json (`saved`) other than the one the
    family always builds (`built_as`). A key left out takes the transformers class's default, which
    is that value (tests/unit/test_init_from.py compares them)."""
    differences = [
        f"{name} {json.dumps(saved[name])} (this family builds {json.dumps(value)})"
        for name, value in built_as.items()
        if saved.get(name, value) != value
    ]
    if differences:
        raise ValueError(f"has {', '.join(differences)}, which no model field configures")


def setting(section: Mapping[str, Any], key: str, default: Any) -> Any:
    """A section value, or `default` when it is absent or None (the schema fills defaults, tests may not)."""
    value = section.get(key)
    return default if value is None else value


def count_parameters(module: torch.nn.Module) -> int:
    """Unique parameters: `parameters()` yields a tied tensor once, so tied embeddings count once."""
    return sum(parameter.numel() for parameter in module.parameters())


def check_state_dict(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> None:
    """Refuse a state dict whose names or shapes differ from the model's.

    Exporting is the last step of a run; a prefixed or truncated state dict must fail here rather
    than produce a directory that loads with freshly initialised weights.
    """
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    mismatched = sorted(
        f"{key} {tuple(given[key].shape)} != {tuple(expected[key].shape)}"
        for key in set(expected) & set(given)
        if given[key].shape != expected[key].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched))
        if keys
    ]
    if problems:
        raise ValueError("state dict does not match the configured model; " + "; ".join(problems))


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (a ResNet's batch-norm statistics), by name: the model's state
    that no optimizer keeps and that each rank updates on its own."""
    parameters = {id(parameter) for parameter in module.parameters()}
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) not in parameters}


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch alike on every rank, so that every rank builds the same weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# -- Causal language models (the GPT and Llama families) --------------------------------------
# transformers is imported inside the functions: config validation reads the family modules
# without building a model and would otherwise spend most of its time importing it.

EVAL_SUMS = ("loss_sum", "tokens")
# Both train on token samples, `data.seq_len` of them each, with the vocabulary from the tokenizer.
TOKEN_DATA_TYPES = ("text", "tokens", "chat", "instruction", "synthetic")
# math.exp overflows above this; a diverged run should report an infinite perplexity, not crash.
_LARGEST_EXP_ARGUMENT = math.log(sys.float_info.max)


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
            "enum": ["full", "tiled", "fused"],
            "description": '"full": the model computes the logits of every position, and the loss holds them in '
            "fp32 with their gradient (8 bytes x vocabulary per token, gigabytes per sequence of a Llama 3 "
            'vocabulary). "tiled": as Arctic Long Sequence Training tiles it, the head and the loss piece by '
            "piece over the positions, each piece's fp32 logits at most 1 GiB and recomputed in the backward "
            "pass (models/tiling.py): the same loss and gradients, without the whole logits; trainer.compile "
            'compiles it with the model on the DeepSpeed backend. "fused": Liger-Kernel\'s fused linear '
            "cross-entropy (Triton) on CUDA where liger-kernel is installed and the head is neither split by tensor "
            'parallelism nor partitioned by ZeRO-3; "tiled" everywhere else. Both also compute the evaluation '
            "loss. Without pipeline parallelism.",
            "default": "full",
        },
    }


# ALST's tiling (models/tiling.py: model.tiled_mlp, model.loss "tiled" and its fallback for "fused"),
# how many pieces a rank's tokens are cut into: what the runtime runs and the planner counts.
LOSS_PIECE_BYTES = 2**30  # fp32 logits of one piece of the tiled loss, as ALST's recipes size them


def tiled_mlp_pieces(tokens: int, hidden: int) -> int:
    """TiledMLP's pieces of a sequence slice of `tokens`: ALST's ceil(tokens / hidden), so no piece's
    intermediate activations outgrow the hidden states of the whole slice."""
    return max(1, math.ceil(tokens / hidden))


def tiled_loss_pieces(tokens: int, vocab: int) -> int:
    """The tiled loss's pieces of `tokens` positions (models/tiling.py): each piece's fp32 logits at most
    LOSS_PIECE_BYTES."""
    return max(1, math.ceil(tokens * vocab * 4 / LOSS_PIECE_BYTES))


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


# transformers' SDPA attention under a name of the engine's own. Under "sdpa" transformers builds the
# causal mask itself before every forward, and to learn whether the inputs pack several sequences it
# reads their position ids back from the device (`find_packed_sequence_indices`): one host sync per
# forward, outside torch.compile. Under a name it has no mask function for, it builds no mask and
# SDPA masks causally (`is_causal`), the very kernel "sdpa" reaches for unpadded windows. Batches that
# carry position ids (chat and instruction data) bring their own mask instead (`model_inputs`), so
# that packed conversations never attend to each other. The name is not saved with a checkpoint.
CAUSAL_SDPA = "engine_causal_sdpa"
# The keyword under which `model_inputs` hands that mask through the model's forward to each attention.
POSITIONS_MASK = "engine_positions_mask"
# Under sequence parallelism (engine/parallel/sequence.py): the name DeepSpeed's Ulysses wraps, plain
# SDPA on the whole gathered sequence, and the batch key of a slice's positions in the whole sequence.
ULYSSES_SDPA = "engine_ulysses_sdpa"
SHARD_POSITIONS = "shard_position_ids"


def transformers_attention(name: str) -> str:
    """The `attn_implementation` a model is built with for `model.attn_implementation` `name`."""
    if name != "sdpa":
        return name
    from transformers import AttentionInterface

    if CAUSAL_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(CAUSAL_SDPA, causal_sdpa_attention)
    return CAUSAL_SDPA


def causal_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA function, masked by the batch's own mask where `model_inputs` passes one
    (transformers builds none under CAUSAL_SDPA), else causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    positions_mask = kwargs.pop(POSITIONS_MASK, None)
    if attention_mask is None:
        attention_mask = positions_mask
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def positions_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, T, T), true where query i may attend to key j: j <= i, both in one sequence, a new
    one starting wherever the positions do not run on by one (transformers' own rule,
    `find_packed_sequence_indices`), here without reading them back from the device."""
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    sequences = starts.cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return (sequences[:, None, :, None] == sequences[:, None, None, :]) & causal


def settled_vocabulary(arch: Mapping[str, Any]) -> int:
    """The vocabulary size a model is built with, refused while still "auto"."""
    vocab_size = arch["vocab_size"]
    if not isinstance(vocab_size, int):
        raise ValueError(
            f'model.vocab_size is {vocab_size!r}; the engine must replace "auto" with the tokenizer\'s '
            "vocabulary size before building the model"
        )
    return vocab_size


def compute_loss(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], divisor: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token loss over the target tokens (labels other than IGNORE_INDEX, which arrive already
    one token on): their mean, or their sum over `divisor` (engine/backends/token_mean.py), which
    transformers' loss takes as `num_items_in_batch`.

    The model computes it in its own forward (transformers' `ForCausalLMLoss`, `pipeline_loss`'s
    arithmetic), so that a compiled model compiles the loss with it and never writes fp32 logits."""
    labels = batch["labels"].contiguous()
    loss_arguments = {} if divisor is None else {"num_items_in_batch": divisor}
    # No KV cache: training never decodes, and the cache would cost memory on every forward.
    return model(**model_inputs(batch), labels=labels, shift_labels=labels, use_cache=False, **loss_arguments).loss


def eval_sums(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed token loss and the tokens predicted, so the mean over every rank's batches is exact.

    The model's own loss over a divisor of 1, its sum: model.loss "tiled" and "fused" then evaluate
    without the whole logits as they train, and "full" sums `pipeline_eval_sums`' fp32 cross-entropy."""
    labels = batch["labels"]
    loss_sum = compute_loss(model, batch, torch.ones((), device=labels.device))
    return {"loss_sum": loss_sum.detach().double(), "tokens": (labels != IGNORE_INDEX).sum().double()}


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The token ids, and where the data gives position ids (chat and instruction data, restarting at
    each packed conversation) those and the mask that keeps attention within each conversation: built
    once per forward for CAUSAL_SDPA, which builds none (eager attention builds its own from the
    position ids and ignores it). A sequence-parallel slice brings its positions in the whole sequence."""
    inputs = {"input_ids": batch["input_ids"]}
    if SHARD_POSITIONS in batch:
        # A slice of each sequence: Ulysses gathers the positions and masks the whole sequence causally.
        inputs["position_ids"] = batch[SHARD_POSITIONS]
    elif "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"]
        inputs[POSITIONS_MASK] = positions_causal_mask(batch["position_ids"])
    return inputs


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
    loss = sums["loss_sum"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss) if loss <= _LARGEST_EXP_ARGUMENT else math.inf}


def pipeline_batch(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(first stage's input, last stage's labels)."""
    return batch["input_ids"], batch["labels"]


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' own causal-LM loss (fp32 logits), given labels the data already shifted: a
    sample of seq_len inputs carries seq_len targets, where shifting inside would score seq_len - 1."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    # It views the labels flat, as its own shift leaves them contiguous.
    return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=labels.contiguous())


def pipeline_eval_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed in fp32 logits over the tokens that count (labels other than IGNORE_INDEX)."""
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return {"loss_sum": loss.detach().double(), "tokens": (flat != IGNORE_INDEX).sum().double()}


def positions_and_mask(config: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a decoder layer running alone as a pipeline layer needs besides its hidden states: the
    position ids of a whole sequence and the causal mask the whole model would build for it (None
    under SDPA, which masks causally itself)."""
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
    )
    return positions, mask


class TiedEmbedding(nn.Module):
    """A tied token embedding as a pipeline layer: looked up on the first stage, the output
    projection on the last (`tied_embedding_layers`). It holds the model's embedding module under
    the model's own name for it, so the tied weight is `wte.weight` or `embed_tokens.weight`."""

    def __init__(self, **embedding: nn.Module):
        super().__init__()
        ((self.key, module),) = embedding.items()
        self.add_module(self.key, module)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.get_submodule(self.key)(input_ids)


def _tied_head(embedding: TiedEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return tied_logits(embedding.get_submodule(embedding.key), hidden)


def tied_embedding_layers(name: str, embedding: nn.Module) -> tuple[Any, Any]:
    """The first and the last pipeline layer of a model whose head is its token embedding `name`:
    one tied module, so DeepSpeed keeps the first and last stage's copies equal."""
    from deepspeed.pipe import TiedLayerSpec

    weight, module = f"{name}.weight", {name: embedding}
    return (
        TiedLayerSpec("embedding", TiedEmbedding, tied_weight_attr=weight, **module),
        TiedLayerSpec("embedding", TiedEmbedding, forward_fn=_tied_head, tied_weight_attr=weight, **module),
    )


# A decoder block's attention module: Llama's `self_attn`, GPT-2's `attn`.
_ATTENTION_NAMES = ("self_attn", "attn")


def apply_activation_checkpointing(model: torch.nn.Module, choice: Checkpointing = EVERY_BLOCK) -> None:
    """Recompute in the backward pass what `choice` names (models/checkpointing.py) instead of
    keeping its activations, without renaming any parameter.

    Whole blocks: transformers' own switch, non-reentrant (it works with inputs that do not require
    grad, token ids, and with DeepSpeed's ZeRO hooks), then the per-block flag and checkpoint function
    that transformers' GradientCheckpointingLayer documents, for every k-th block and for offloading.
    Attention only: each block's attention module recomputes on its own (`checkpoint_forward`).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if choice.attention:
        for block in blocks:
            checkpoint_forward(next(child for name, child in block.named_children() if name in _ATTENTION_NAMES))
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = choice.recomputes(index)
        block._gradient_checkpointing_func = checkpoint_function(choice.offload)


@dataclass(frozen=True)
class HFCheckpoint:
    """A decoder family as transformers checkpoints hold it, and the family functions that follow
    from that: `build`, `check_init_from`, `export` and `load_export`.

    `model_class` names the transformers class (imported only when a model is built), `kind` the
    architecture in messages, `config` makes the transformers config of a model section. A
    `model.init_from` checkpoint must match that config in `fields` (model-section keys) and `fixed`
    (what the family always builds the same way). A tied embedding is stored once, under
    `embedding`, never also under `head`, as HF's own checkpoints hold it.
    """

    model_class: str
    kind: str
    config: Callable[[Mapping[str, Any]], Any]
    fields: tuple[str, ...]
    fixed: tuple[str, ...]
    embedding: str
    head: str = "lm_head.weight"

    def transformers_class(self) -> type:
        import transformers

        return getattr(transformers, self.model_class)

    def build(self, section: Mapping[str, Any]) -> torch.nn.Module:
        """A training-mode model: fresh weights (`initialised_model`; the caller seeds the RNG, so
        every rank draws the same), or those of `model.init_from`, refused up front when it is not a
        checkpoint of this shape (transformers would load it anyway, leave what is missing freshly
        initialised and only log that it did)."""
        config, init_from = self.config(section), section.get("init_from")
        if init_from is None:
            model = initialised_model(self.transformers_class(), config)
        else:
            self._check(Path(init_from), config)
            model = load_pretrained(self.transformers_class(), Path(init_from), config)
        choice = Checkpointing.of(section.get("activation_checkpointing"))
        if choice:
            apply_activation_checkpointing(model, choice)
        # The loss `compute_loss` has the model compute; GPT2LMHeadModel's class name names none, and
        # transformers would warn before falling back to this same one.
        model.loss_type = "ForCausalLM"
        return model

    def check_init_from(self, section: Mapping[str, Any]) -> None:
        """Refuse a `model.init_from` that is no checkpoint of the configured shape. Reads its config
        only, no weights, so it runs before any process group starts."""
        if section.get("init_from") is not None:
            self._check(Path(section["init_from"]), self.config(section))

    def _check(self, path: Path, config: Any) -> None:
        from transformers import AutoConfig

        try:
            saved = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"model.init_from {path} is not a transformers checkpoint ({reason})") from None
        if not isinstance(saved, type(config)):
            raise ValueError(f"model.init_from {path} holds a {saved.model_type!r} checkpoint, not a {self.kind} one")

        def differences(names: tuple[str, ...]) -> str:
            return ", ".join(
                f"{name} {getattr(saved, name, None)} (configured: {getattr(config, name)})"
                for name in names
                if getattr(saved, name, None) != getattr(config, name)
            )

        configurable, fixed = differences(self.fields), differences(self.fixed)
        problems = (
            [f"{configurable}; set these fields in the model section to match the checkpoint"] if configurable else []
        )
        problems += [f"{fixed}, which this family does not configure"] if fixed else []
        if problems:
            raise ValueError(f"model.init_from {path} has a different architecture: {'; '.join(problems)}")

    def export(
        self,
        state_dict: Mapping[str, torch.Tensor],
        section: Mapping[str, Any],
        out_dir: Path,
        class_names: Sequence[str] | None = None,
    ) -> None:
        """An HF checkpoint directory (config.json, model.safetensors) that plain `from_pretrained`
        of the family's class loads, holding exactly the weights in `state_dict`. `class_names` is
        in every family's signature for classifiers; a language model has none to record."""
        if class_names is not None:
            raise ValueError(f"a {self.kind} model has no classes, yet was given {len(class_names)} class names")
        config = self.config(section)
        # Only the config and the parameter names of this model are used; the weights are `state_dict`.
        with torch.device("meta"):
            model = self.transformers_class()(config)
        expected = model.state_dict()
        weights = dict(state_dict)
        if config.tie_word_embeddings:
            weights = _one_embedding_key(weights, self.embedding, self.head)
            expected = {key: value for key, value in expected.items() if key != self.head}
        check_state_dict(expected, weights)
        model.save_pretrained(out_dir, state_dict=weights)

    def load_export(self, path: Path) -> torch.nn.Module:
        """The exported model, in eval mode as `from_pretrained` returns it."""
        return self.transformers_class().from_pretrained(path, local_files_only=True)


def initialised_model(model_class: type, config: Any) -> torch.nn.Module:
    """Fresh weights, drawn only after construction, module by module in `initialize_weights`' order.

    That is the order transformers draws them in when it builds the model partitioned under ZeRO-3
    (`deepspeed.zero.Init`, then `initialize_weights_zero3`), while a plain constructor would first
    spend the RNG on torch's default initialisation: drawn this way, a ZeRO-3 run starts from the same
    weights as every other layout.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return AutoModelForCausalLM.from_config(config).train()
    with no_init_weights():
        model = model_class(config)
    model.initialize_weights()
    model.tie_weights()
    return model


def load_pretrained(model_class: type, path: Path, config: Any) -> torch.nn.Module:
    """Weights from a local HF checkpoint (already checked against `config`), built with `config`'s
    dropout and attention kernel. transformers would load a checkpoint lacking weights anyway, leave
    them freshly initialised and only log that it did; this refuses it."""
    model, loading_info = model_class.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    absent = sorted(loading_info["missing_keys"]) + sorted(map(str, loading_info["mismatched_keys"]))
    if absent:
        raise ValueError(f"model.init_from {path} lacks weights the model needs: {', '.join(absent[:5])}")
    return model.train()


def _one_embedding_key(weights: dict[str, torch.Tensor], embedding: str, head: str) -> dict[str, torch.Tensor]:
    """Consolidated checkpoints name a tied tensor under either key or both: keep `embedding` only."""
    tied = weights.pop(head, None)
    if tied is None:
        return weights
    kept = weights.setdefault(embedding, tied)
    if kept is not tied and not torch.equal(kept, tied):
        raise ValueError(f"{embedding} and {head} differ, but the model ties them into one tensor")
    return weights


def sequence_issues(data: Mapping[str, Any], context: int, context_field: str) -> Iterator[tuple[str, str]]:
    """A sequence longer than the model's context (`context_field`). A vocabulary the tokenizer
    overflows is the engine's rule (engine/config/rules.py), which knows which data reads a tokenizer."""
    seq_len = data.get("seq_len", AUTO)
    if seq_len != AUTO and seq_len > context:
        yield (
            "data.seq_len",
            f"{seq_len} is longer than model.{context_field} {context}; shorten it or raise {context_field}",
        )


def decoder_activations(
    shape: PlanShape,
    hidden: int,
    vocab: int,
    layer_factor: Callable[[int], float],
    mlp_factor: Callable[[int], float],
    attention_width: int,
    attention_factor: Callable[[int], float],
) -> ActivationEstimate:
    """The planner's activation estimate for a decoder of width `hidden`: one transformer layer
    keeps tokens * hidden * `layer_factor(tensor)` bytes at 2 bytes per element and tensor-parallel
    degree `tensor` (Korthikanti et al. 2022, arXiv:2205.05198, without Megatron's sequence
    parallelism), scaled to the training dtype. A layer recomputed whole (`Checkpointing`) keeps only
    its input (one hidden state per token), in host memory where it offloads, and one such layer is
    recomputed at a time (on top of the others' only where the last layer is one of them); under
    attention-only recompute each attention module, `attention_factor(tensor)` of the layer's per
    token with its input, keeps only that input, and one recomputes at a time. The last stage adds
    the fp32 logits and their gradient. Every stage boundary and tensor-parallel
    all-reduce moves one hidden state of the micro-batch's tokens.

    Under Ulysses (`shape.sequence` ranks) a rank holds seq_len / SP tokens of each sequence outside
    attention and, inside it, the whole sequence for heads / SP of the heads: as many elements of
    query, keys, values and output, so `tokens` is the rank's slice and `layer_factor` counts the
    attention scores of the whole sequence per token of it. model.tiled_mlp: the MLP keeps only its
    input (counted among the layer's whole tensors); its intermediate activations, `mlp_factor(tensor)`
    of the layer's per token, exist for one piece (`tiled_mlp_pieces`) of one layer at a time, while
    that piece is recomputed in the backward pass. model.loss "tiled" (and "fused", whose Liger chunks
    are smaller): the logits of one piece (`tiled_loss_pieces`) instead of all of them."""
    slice_length = shape.data["seq_len"] // shape.sequence
    tokens = slice_length * shape.micro_batch

    def bytes_of(count: int, factor: float) -> int:
        return int(count * hidden * factor * shape.element / 2)

    layer, recomputed = bytes_of(tokens, layer_factor(shape.tensor)), 0
    if shape.section.get("tiled_mlp", False):
        piece = math.ceil(tokens / tiled_mlp_pieces(slice_length, hidden))
        layer -= bytes_of(tokens, mlp_factor(shape.tensor))
        recomputed = bytes_of(piece, mlp_factor(shape.tensor))
    logit_tokens = tokens
    if shape.section.get("loss", "full") != "full":
        logit_tokens = math.ceil(tokens / tiled_loss_pieces(tokens, vocab))

    # One hidden state per token: a layer's input, and its attention module's.
    block_input = tokens * hidden * shape.element
    attention_internals = bytes_of(tokens, attention_factor(shape.tensor)) - block_input

    def stage_bytes(stage: int, layers: int, checkpointing: Checkpointing) -> int:
        whole = checkpointing.recomputed(layers)
        kept = (layers - whole) * layer + recomputed if layers else 0
        if whole:
            kept += 0 if checkpointing.offload else whole * block_input
            # The last block runs its backward first; any after the last recomputed one have
            # freed theirs by the time it is recomputed.
            if checkpointing.recomputes(layers - 1):
                kept += layer
        if checkpointing.attention and layers:
            kept -= (layers - 1) * attention_internals
        logits = 2 * 4 * logit_tokens * vocab // shape.tensor if stage == shape.stages - 1 else 0
        return kept + logits

    return ActivationEstimate(stage_bytes, tokens, hidden, [tokens * hidden] * (shape.stages - 1), attention_width)
