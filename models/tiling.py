"""ALST's memory tiling (model.tiled_mlp, model.loss "tiled", "fused" and "auto"): the MLP
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
vocabulary-split head (parallelism/tensor.py) gathers each piece's logits; it is part of the
model's forward, so `trainer.compile` compiles it with the model where DeepSpeed compiles the whole
module (accelerate compiles the blocks and transformers' loss function, not this).

"fused" computes the head's gradients in the forward, piece by piece, and scales them by what
arrives in backward, so every scaling above reaches the head too, and nothing is computed twice:
Liger-Kernel's fused linear cross-entropy (Triton) on CUDA where it is installed,
`FusedLinearCrossEntropy` (the same algorithm in PyTorch) elsewhere. It needs the head's whole
weight, so a head that ZeRO-3 or FSDP partitions or tensor parallelism splits takes "tiled".
"auto", the default, is "fused" where the head is whole and the logits span more than one piece
(where it holds less), and the model's own loss otherwise (`auto_is_fused`).
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

from models.labels import IGNORE_INDEX
from models.tile_sizes import AUTO_LOSS, tiled_loss_pieces, tiled_mlp_pieces


def apply_tiling(model: nn.Module, section: Mapping[str, Any]) -> None:
    """Tile what the model section asks for, in place; parameter names stay as they are."""
    if section.get("tiled_mlp", False):
        # Each decoder layer's feed-forward block, `mlp` in every transformers decoder family here.
        for name, module in model.named_modules():
            if name.endswith(".mlp"):
                module.forward = types.MethodType(_tiled_mlp_forward, module)
    loss = section.get("loss", AUTO_LOSS)
    if loss != "full":
        cross_entropy = logits_free_loss(loss)
        auto = loss == AUTO_LOSS

        # A function, not a partial: torch.compile traces a bound method only where it finds its source.
        def forward(self: nn.Module, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
            return _loss_forward(cross_entropy, auto, self, input_ids, **kwargs)

        model.forward = types.MethodType(forward, model)


def _tiled_mlp_forward(self: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    pieces = tiled_mlp_pieces(hidden.shape[-2], hidden.shape[-1])
    return TiledMLP.apply(type(self).forward, self, hidden, pieces, list(self.parameters()))


CrossEntropy = Callable[[nn.Module, torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


def logits_free_loss(loss: str) -> CrossEntropy:
    """model.loss "tiled" or "fused" (or "auto", whose choice is "fused"'s) as a function of the head,
    the last hidden states, the labels (already shifted), the vocabulary and the divisor; the
    pipeline's last stage calls it with its head layer (engine/backends/pipeline_backend.py)."""
    if loss == "tiled":
        return tiled_cross_entropy
    # Liger is looked up here, at build time: an import inside the forward would be traced by torch.compile.
    return functools.partial(fused_cross_entropy, _liger_loss())


def _loss_forward(
    cross_entropy: CrossEntropy, auto: bool, self: nn.Module, input_ids: torch.Tensor | None = None, **kwargs: Any
) -> Any:
    """The causal LM's forward where a loss is asked for (`models.loss.compute_loss` and
    `eval_sums` pass labels already shifted, as `shift_labels`): `cross_entropy` from the last hidden
    states, no logits returned; the model's own forward otherwise, and under model.loss "auto" where
    `auto_is_fused` says the fused loss would hold no less or cannot run."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = kwargs.get("shift_labels")
    if labels is None or (
        auto and not auto_is_fused(self.get_output_embeddings(), labels.numel(), self.config.vocab_size)
    ):
        return type(self).forward(self, input_ids=input_ids, **kwargs)
    kwargs.pop("shift_labels")
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
    liger: nn.Module | None,
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    vocab: int,
    divisor: torch.Tensor | None = None,
) -> torch.Tensor:
    """`tiled_cross_entropy`'s loss with the head's gradient computed in the forward, piece by piece,
    where the head is a plain linear layer: by Liger-Kernel's fused linear cross-entropy (`liger`) on
    CUDA where it is installed, by `FusedLinearCrossEntropy` elsewhere. A vocabulary-split head
    (tensor parallelism) needs a cross-entropy over the ranks' slices, and under ZeRO-3 the head's
    weight is whole only inside the head's own forward, which neither calls: both take the tiled loss."""
    if not _plain_linear(head):
        return tiled_cross_entropy(head, hidden, labels, vocab, divisor)
    labels = labels.reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if liger is not None and hidden.is_cuda:
        total = liger(head.weight, hidden, labels, head.bias)
    elif torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
        pieces = tiled_loss_pieces(labels.numel(), vocab)
        total = FusedLinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, pieces)
    else:  # evaluation: no gradient to compute
        pieces = tiled_loss_pieces(labels.numel(), vocab)
        total = sum(
            _summed_loss(head, *piece)
            for piece in zip(hidden.tensor_split(pieces), labels.tensor_split(pieces), strict=True)
        )
    return total / _targets(labels, divisor)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of `hidden @ weight.T + bias` (fp32 logits, as transformers' loss),
    with the gradients of hidden, weight and bias computed in the forward one piece of positions at a
    time, as Liger-Kernel's Triton kernel does, in PyTorch: no piece's logits outlive the piece, and
    nothing is computed twice (the tiled loss computes each piece's logits again in backward). The
    backward scales the kept gradients by the incoming one, so DeepSpeed's 1/accumulation, fp16's
    loss scale and the ZeRO-3 and sequence-parallel corrections reach the head as they reach the body.
    The weight's gradient accumulates in fp32 over the pieces."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        pieces: int,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        start = 0
        for piece, targets in zip(hidden.tensor_split(pieces), labels.tensor_split(pieces), strict=True):
            logits = F.linear(piece, weight, bias).float()
            total += F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
            # d(loss)/d(logits): softmax less one at the target, zero on ignored positions.
            grad = logits.softmax(dim=-1)
            del logits
            # Static shapes throughout (no boolean indexing), so torch.compile keeps it in one graph.
            kept = (targets != IGNORE_INDEX).unsqueeze(1)
            grad.scatter_add_(1, torch.where(kept, targets.unsqueeze(1), 0), -kept.to(grad.dtype))
            grad.mul_(kept)
            grad = grad.to(weight.dtype)
            end = start + len(targets)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.t().float(), piece.float())
            if grad_bias is not None:
                grad_bias += grad.float().sum(dim=0)
            start = end
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors

        def scaled(grad: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
            # In place: the kept gradients are this backward's alone, and a copy of the head's would double it.
            return None if grad is None else grad.mul_(grad_total).to(dtype or grad.dtype)

        return (
            scaled(grad_hidden, None),
            scaled(grad_weight, ctx.weight_dtype),
            scaled(grad_bias, ctx.weight_dtype),
            None,
            None,
        )


def auto_is_fused(head: nn.Module, tokens: int, vocab: int) -> bool:
    """model.loss "auto": the fused loss where its logits of `tokens` positions span more than one
    piece (so it holds less than the whole logits) and the head is one it computes whole (ZeRO-3's,
    FSDP2's and tensor parallelism's heads, whose tiled loss gathers per piece, keep the full loss)."""
    return _plain_linear(head) and tiled_loss_pieces(tokens, vocab) > 1


def _plain_linear(head: nn.Module) -> bool:
    # ZeRO-3 marks each parameter it partitions with its id; FSDP2 holds a DTensor's shard.
    from torch.distributed.tensor import DTensor  # imports sympy: not for the config's checks

    if type(head) is not nn.Linear:
        return False
    return not hasattr(head.weight, "ds_id") and not isinstance(head.weight, DTensor)


def _liger_loss() -> nn.Module | None:
    """Liger's loss summed over the targets (the caller divides), or None where liger-kernel, an
    optional dependency for CUDA, is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum")
