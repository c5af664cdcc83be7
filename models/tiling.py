"""ALST's memory tiling for long sequences (model.tiled_mlp, model.loss "tiled" and "fused"): the MLP
and the loss computed over pieces of the sequence, so that neither the MLP's intermediate activations
nor the logits of the whole sequence are ever held at once.

The MLP is DeepSpeed's own `TiledMLP`: the forward runs piece by piece without keeping anything but
the block's input, and the backward computes each piece again with its gradient. It tells ZeRO when
a weight's gradient is whole (`ds_grad_is_ready`).

The loss is the engine's own. DeepSpeed's `TiledFusedLogitsLoss` computes the head's gradient
inside the forward and scales only the input's gradient by what arrives in backward, so the head
would miss DeepSpeed's division by the accumulation steps, fp16's loss scale and the engine's
ZeRO-3 correction (engine/parallel/sequence.py). Here each piece's summed loss runs under torch's
non-reentrant checkpoint: the forward keeps each piece's hidden states and labels, not its logits,
and the backward computes one piece's logits again at a time, its gradients flowing through
autograd like any other. It calls the head module itself, so ZeRO-3 gathers its weight and a
vocabulary-split head (models/tensor_parallel.py) gathers each piece's logits; it is part of the
model's forward, so `trainer.compile` compiles it with the model where DeepSpeed compiles the whole
module (accelerate compiles the blocks and transformers' loss function, not this).

"tiled" and "fused" stay two names for two promises: "tiled" is this PyTorch loss on every device,
"fused" is Liger-Kernel's fused linear cross-entropy (Triton: the head's gradient computed chunk by
chunk in the forward, about the hidden states' size of logits at a time, and scaled by what arrives
in backward, so every scaling above reaches it) wherever it can run, this loss elsewhere.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
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
    loss = section.get("loss", "full")
    if loss != "full":
        # Liger is looked up here, at build time: an import inside the forward would be traced by torch.compile.
        liger = _liger_loss() if loss == "fused" else None
        cross_entropy = tiled_cross_entropy if liger is None else functools.partial(fused_cross_entropy, liger)
        model.forward = types.MethodType(functools.partial(_loss_forward, cross_entropy), model)


def _tiled_mlp_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    pieces = tiled_mlp_pieces(hidden.shape[-2], hidden.shape[-1])
    return TiledMLP.apply(type(self).forward, self, hidden, pieces, list(self.parameters()))


CrossEntropy = Callable[[nn.Module, torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def _loss_forward(
    cross_entropy: CrossEntropy, self: nn.Module, input_ids: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """The causal LM's forward where a loss is asked for (`models.common.compute_loss` and
    `eval_sums` pass labels already shifted, as `shift_labels`): `cross_entropy` from the last hidden
    states, no logits returned; the model's own forward otherwise."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = kwargs.pop("shift_labels", None)
    if labels is None:
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    kwargs.pop("labels", None)
    divisor = kwargs.pop("num_items_in_batch", None)
    hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
    # The configured vocabulary: a vocabulary-split head holds only this rank's rows of it.
    loss = cross_entropy(self.get_output_embeddings(), hidden, labels, self.config.vocab_size, divisor)
    return CausalLMOutputWithPast(loss=loss)


def tiled_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, vocab: int, divisor: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' causal-LM loss (fp32 logits; summed over the targets and divided by `divisor`,
    else their mean) from the last hidden states, one piece of positions at a time; the head returns
    `vocab` logits per position."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    pieces = tiled_loss_pieces(labels.numel(), vocab)
    total = sum(
        checkpoint(_summed_loss, head, piece, targets, use_reentrant=False)
        for piece, targets in zip(hidden.tensor_split(pieces), labels.tensor_split(pieces), strict=True)
    )
    return total / _targets(labels, divisor)


def _summed_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def _targets(labels: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum() if divisor is None else divisor


def fused_cross_entropy(
    liger: nn.Module,
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    vocab: int,
    divisor: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tiled_cross_entropy`'s loss by Liger-Kernel's fused linear cross-entropy (`liger`) where it
    can run: on CUDA, for a plain linear head. A vocabulary-split head (tensor parallelism) would need
    a cross-entropy over the ranks' slices, and under ZeRO-3 the head's weight is whole only inside
    the head's own forward, which Liger never calls: both take the tiled loss."""
    if not (hidden.is_cuda and _plain_linear(head)):
        return tiled_cross_entropy(head, hidden, labels, vocab, divisor)
    labels = labels.reshape(-1)
    total = liger(head.weight, hidden.reshape(-1, hidden.shape[-1]), labels, head.bias)
    return total / _targets(labels, divisor)


def _plain_linear(head: nn.Module) -> bool:
    # ZeRO-3 marks each parameter it partitions with its id.
    return type(head) is nn.Linear and not hasattr(head.weight, "ds_id")


def _liger_loss() -> nn.Module | None:
    """Liger's loss summed over the targets (the caller divides), or None where liger-kernel, an
    optional dependency for CUDA, is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
