"""What training a family costs, in the terms every family states it: model FLOPs per trained item
(the MFU's numerator) and the activation bytes and boundary tensors the planner (engine/plan) weighs.

The FLOPs are *model* FLOPs, the convention of PaLM's MFU (Chowdhery et al. 2022, arXiv:2204.02311,
appendix B): what one training step needs mathematically, so recomputation, padding and redundant
work do not raise the figure. One multiply-accumulate is two FLOPs, and training costs three
forward passes: the backward pass computes the gradient of every matmul with respect to both its
input and its weights, each as costly as the forward product.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.activation_checkpointing import Checkpointing
from models.tile_sizes import AUTO_LOSS, tiled_loss_pieces, tiled_mlp_pieces

FLOPS_PER_MAC = 2
TRAINING_PASSES = 3  # forward, then backward's input gradient and weight gradient


def forward_macs(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of every `nn.Conv2d` and `nn.Linear` in one forward pass, per sample.

    Hooks read the output shapes the real model produces, so strides, padding and the implementation
    are followed without restating the architecture. Normalisation, activations, pooling and residual
    additions are left out (about 1% of a ResNet's work), as the ResNet paper's "multiply-adds" (He et
    al. 2016, arXiv:1512.03385, table 1) leave them out.
    """
    macs = 0

    def count(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        nonlocal macs
        outputs_per_sample = output.numel() // output.shape[0]
        if isinstance(module, nn.Conv2d):
            kernel_h, kernel_w = module.kernel_size
            macs += outputs_per_sample * (module.in_channels // module.groups) * kernel_h * kernel_w
        else:
            macs += outputs_per_sample * module.in_features

    handles = [
        module.register_forward_hook(count) for module in model.modules() if isinstance(module, nn.Conv2d | nn.Linear)
    ]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    return macs


def module_output_bytes(model: nn.Module, example: torch.Tensor, element: int) -> int:
    """Sum of every leaf module's output in one forward pass on the meta device: what autograd
    keeps for backward, roughly (some outputs are freed, some inputs are kept as well)."""
    total = 0

    def count(_module: nn.Module, _inputs: tuple, output: Any) -> None:
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * element

    leaves = [module for module in model.modules() if not list(module.children())]
    handles = [module.register_forward_hook(count) for module in leaves]
    try:
        model(example)
    finally:
        for handle in handles:
            handle.remove()
    return total


@dataclass(frozen=True)
class PlanShape:
    """What the planner knows of a run when it asks a family for its activations.

    `section` is the model section with its vocabulary settled, `data` the resolved data section;
    `model` is the whole model on the meta device, cut into `stages` pipeline stages at `parts`
    (stage s holds layers parts[s] to parts[s + 1] - 1 of the family's pipeline form). `sequence`
    ranks split every sequence (Ulysses): each holds data.seq_len / sequence of its tokens.
    """

    section: Mapping[str, Any]
    data: Mapping[str, Any]
    model: nn.Module
    parts: tuple[int, ...]
    stages: int
    tensor: int  # tensor-parallel degree
    micro_batch: int
    element: int  # bytes per activation element at the run's compute precision
    sequence: int = 1  # sequence-parallel degree
    whole_head: bool = True  # the head's weight whole on the rank (not ZeRO-3's, FSDP's or split by tensor parallelism)


@dataclass(frozen=True)
class ActivationEstimate:
    """A family's answer to the planner, all of it estimates.

    `stage_bytes(stage, blocks, checkpointing)`: the activations one micro-batch leaves for backward
    in device memory on one rank of `stage`, which holds `blocks` of the family's repeating blocks,
    under activation checkpointing choice `checkpointing` (models/activation_checkpointing.py); what an offloading
    choice keeps in host memory is the difference from the same choice without offload.
    `tokens` and `hidden`: the positions of a micro-batch on one rank (its slice of each sequence
    under sequence parallelism) and the width of the hidden state that tensor-parallel layers
    all-reduce (0 for a family without a tensor-parallel form).
    `boundaries[s]`: the elements stage s sends the next one per micro-batch.
    `attention_width`: the elements per token of the query, keys, values and attention output that
    sequence parallelism's all-to-alls move in each block (0 for a family without attention).
    """

    stage_bytes: Callable[[int, int, Checkpointing], int]
    tokens: int
    hidden: int
    boundaries: list[int]
    attention_width: int = 0


def keeps_scores(arch: Mapping[str, Any]) -> bool:
    """Whether a decoder's attention keeps its (heads x seq x seq) scores for backward: the eager
    attention does; SDPA runs a flash or memory-efficient kernel that keeps the log-sum-exp instead
    (CPU's flash kernel even with a mask), except with attention dropout, which CPU's kernels leave to
    the math kernel (CUDA's flash kernel does not: there the plan counts scores it need not)."""
    return arch["attn_implementation"] == "eager" or arch["dropout"] > 0


def decoder_activations(
    shape: PlanShape,
    hidden: int,
    vocab: int,
    layer_factor: Callable[[int], float],
    mlp_factor: Callable[[int], float],
    attention_width: int,
    attention_factor: Callable[[int], float],
    final_norm_factor: float,
) -> ActivationEstimate:
    """The planner's activation estimate for a decoder of width `hidden`: one transformer layer
    keeps tokens * hidden * `layer_factor(tensor)` bytes at 2 bytes per element and tensor-parallel
    degree `tensor` (Korthikanti et al. 2022, arXiv:2205.05198, without Megatron's sequence
    parallelism), scaled to the training dtype. A layer recomputed whole (`Checkpointing`) keeps only
    its input (one hidden state per token), in host memory where it offloads, and one such layer is
    recomputed at a time (on top of the others' only where the last layer is one of them); under
    attention-only recompute each attention module, `attention_factor(tensor)` of the layer's per
    token with its input, keeps only that input, and one recomputes at a time. The last stage adds
    what the loss holds. Every stage boundary and tensor-parallel
    all-reduce moves one hidden state of the micro-batch's tokens.

    Under Ulysses (`shape.sequence` ranks) a rank holds seq_len / SP tokens of each sequence outside
    attention and, inside it, the whole sequence for heads / SP of the heads: as many elements of
    query, keys, values and output, so `tokens` is the rank's slice and `layer_factor` counts the
    attention scores of the whole sequence per token of it. model.tiled_mlp: the MLP keeps only its
    input (counted among the layer's whole tensors); its intermediate activations, `mlp_factor(tensor)`
    of the layer's per token, exist for one piece (`tiled_mlp_pieces`) of one layer at a time, while
    that piece is recomputed in the backward pass.

    The last stage adds the final norm's saved tensors, `final_norm_factor` per token as the layer's.
    The peak comes at the start of a backward pass: every layer's saved activations, plus the larger
    of what the loss holds then and one layer's gradients in flight (as large as its activations).
    The loss, measured on CPU (docs/benchmarks.md, memory-walls): "full" holds three fp32 tensors of
    the micro-batch's logits (the logits, their log-softmax and its gradient); "tiled" two of one
    piece (`tiled_loss_pieces`: its log-softmax and gradient, computed again in backward); "fused"
    two of one piece (logits and softmax) and the hidden states' gradient, kept from the forward;
    "auto" is "fused" where the head is whole and the logits span more than one piece
    (models/tiling.py `auto_is_fused`)."""
    slice_length = shape.data["seq_len"] // shape.sequence
    tokens = slice_length * shape.micro_batch

    def bytes_of(count: int, factor: float) -> int:
        return int(count * hidden * factor * shape.element / 2)

    layer, recomputed = bytes_of(tokens, layer_factor(shape.tensor)), 0
    if shape.section.get("tiled_mlp", False):
        piece = math.ceil(tokens / tiled_mlp_pieces(slice_length, hidden))
        layer -= bytes_of(tokens, mlp_factor(shape.tensor))
        recomputed = bytes_of(piece, mlp_factor(shape.tensor))
    loss_bytes = _loss_bytes(shape, tokens, hidden, vocab)
    final_norm = bytes_of(tokens, final_norm_factor)

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
        in_flight = layer if layers else 0
        if stage < shape.stages - 1:
            return kept + in_flight
        return kept + final_norm + max(in_flight, loss_bytes)

    return ActivationEstimate(stage_bytes, tokens, hidden, [tokens * hidden] * (shape.stages - 1), attention_width)


def _loss_bytes(shape: PlanShape, tokens: int, hidden: int, vocab: int) -> int:
    """What model.loss holds at the start of the backward pass, on one rank (see `decoder_activations`)."""
    loss = shape.section.get("loss", AUTO_LOSS)
    pieces = tiled_loss_pieces(tokens, vocab)
    if loss == AUTO_LOSS:
        loss = "fused" if shape.whole_head and shape.tensor == 1 and shape.stages == 1 and pieces > 1 else "full"
    if loss == "fused" and not (shape.whole_head and shape.tensor == 1):
        loss = "tiled"
    logits = 4 * tokens * vocab // shape.tensor
    if loss == "full":
        return 3 * logits
    piece = math.ceil(logits / pieces)
    return 2 * piece if loss == "tiled" else 2 * piece + tokens * hidden * shape.element
