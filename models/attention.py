"""How a causal language model's attention is masked: the attention functions registered under the
engine's own names, and the inputs (position ids, the mask they imply) a batch hands the model.

transformers is imported inside the functions: config validation reads the family modules without
building a model and would otherwise spend most of its time importing it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

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
