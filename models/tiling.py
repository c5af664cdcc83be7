"""ALST's memory tiling for long sequences (model.tiled_mlp, model.loss "tiled"): the MLP and the
loss computed over pieces of the sequence, so that neither the MLP's intermediate activations nor
the logits of the whole sequence are ever held at once.

The MLP is DeepSpeed's own `TiledMLP`: the forward runs piece by piece without keeping anything but
the block's input, and the backward computes each piece again with its gradient. It tells ZeRO when
a weight's gradient is whole (`ds_grad_is_ready`).

The loss is the engine's own. DeepSpeed's `TiledFusedLogitsLoss` computes the head's gradient
inside the forward and scales only the input's gradient by what arrives in backward, so the head
would miss DeepSpeed's division by the accumulation steps, fp16's loss scale and the engine's
ZeRO-3 correction (engine/parallel/sequence.py). Here each piece's summed loss runs under torch's
non-reentrant checkpoint: the forward keeps each piece's hidden states and labels, not its logits,
and the backward computes one piece's logits again at a time, its gradients flowing through
autograd like any other.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from models.common import IGNORE_INDEX, tiled_loss_pieces, tiled_mlp_pieces


def apply_tiling(model: nn.Module, section: Mapping[str, Any]) -> None:
    """Tile what the model section asks for, in place; parameter names stay as they are."""
    if section.get("tiled_mlp", False):
        # Each decoder layer's feed-forward block, `mlp` in every transformers decoder family here.
        for name, module in model.named_modules():
            if name.endswith(".mlp"):
                module.forward = types.MethodType(_tiled_mlp_forward, module)
    if section.get("loss", "full") == "tiled":
        model.forward = types.MethodType(_tiled_loss_forward, model)


def _tiled_mlp_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    pieces = tiled_mlp_pieces(hidden.shape[-2], hidden.shape[-1])
    return TiledMLP.apply(type(self).forward, self, hidden, pieces, list(self.parameters()))


def _tiled_loss_forward(self: nn.Module, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """The causal LM's forward where a training loss is asked for (`models.common.compute_loss`
    passes labels already shifted, as `shift_labels`); the model's own forward otherwise."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = kwargs.pop("shift_labels", None)
    if labels is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    kwargs.pop("labels", None)
    divisor = kwargs.pop("num_items_in_batch", None)
    hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
    return CausalLMOutputWithPast(loss=tiled_cross_entropy(self.get_output_embeddings(), hidden, labels, divisor))


def tiled_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' causal-LM loss (fp32 logits; summed over the targets and divided by `divisor`,
    else their mean) from the last hidden states, one piece of positions at a time."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    pieces = tiled_loss_pieces(labels.numel(), head.weight.shape[0])
    total = sum(
        checkpoint(_summed_loss, head, piece, targets, use_reentrant=False)
        for piece, targets in zip(hidden.tensor_split(pieces), labels.tensor_split(pieces), strict=True)
    )
    if divisor is None:
        divisor = (labels != IGNORE_INDEX).sum()
    return total / divisor


def _summed_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
