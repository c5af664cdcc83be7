"""What training a family costs, in the terms every family states it: model FLOPs per trained item
(the MFU's numerator) and the activation bytes and boundary tensors the planner (engine/plan) weighs.

The FLOPs are *model* FLOPs, the convention of PaLM's MFU (Chowdhery et al. 2022, arXiv:2204.02311,
appendix B): what one training step needs mathematically, so recomputation, padding and redundant
work do not raise the figure. One multiply-accumulate is two FLOPs, and training costs three
forward passes: the backward pass computes the gradient of every matmul with respect to both its
input and its weights, each as costly as the forward product.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.checkpointing import Checkpointing

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


@dataclass(frozen=True)
class ActivationEstimate:
    """A family's answer to the planner, all of it estimates.

    `stage_bytes(stage, blocks, checkpointing)`: the activations one micro-batch leaves for backward
    in device memory on one rank of `stage`, which holds `blocks` of the family's repeating blocks,
    under activation checkpointing choice `checkpointing` (models/checkpointing.py); what an offloading
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
