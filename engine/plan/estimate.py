"""The estimates beside the exact model states: activation memory, communication volume per step
and the pipeline bubble. These are formulas from the literature, not measurements; they say so
wherever they are printed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def gpt_activation_bytes(
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
class Communication:
    """Bytes one rank sends per optimizer step, by collective (ring algorithms: all-reduce moves
    2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N each)."""

    data_parallel: dict[str, int]
    tensor_parallel: int
    pipeline: int

    @property
    def total(self) -> int:
        return sum(self.data_parallel.values()) + self.tensor_parallel + self.pipeline


def data_parallel_bytes(zero_stage: int, elements: int, element: int, dp: int) -> dict[str, int]:
    """ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated
    parameters; ZeRO-3 also all-gathers every parameter in forward and again in backward."""
    if dp == 1:
        return {}
    volume = elements * element
    ring = (dp - 1) / dp
    if zero_stage == 0:
        return {"all-reduce gradients": int(2 * ring * volume)}
    if zero_stage in (1, 2):
        return {"reduce-scatter gradients": int(ring * volume), "all-gather parameters": int(ring * volume)}
    return {"reduce-scatter gradients": int(ring * volume), "all-gather parameters (fwd+bwd)": int(2 * ring * volume)}


def tensor_parallel_bytes(layers: int, hidden: int, tokens: int, element: int, tensor: int, micro_batches: int) -> int:
    """Megatron's four all-reduces of the hidden states per layer and micro-batch (two forward,
    two backward), plus the embedding's forward all-reduce, each 2(t-1)/t of s*b*h elements."""
    if tensor == 1:
        return 0
    per_all_reduce = 2 * (tensor - 1) / tensor * tokens * hidden * element
    return int(micro_batches * (4 * layers + 1) * per_all_reduce)


def pipeline_bytes(boundaries: Sequence[int], element: int, stage: int, micro_batches: int) -> int:
    """Point-to-point: a stage's output activations to the next stage and, backward, the gradient
    of its input to the one before, per micro-batch. `boundaries[s]`: the elements stage s sends on."""
    forward = boundaries[stage] if stage < len(boundaries) else 0
    backward = boundaries[stage - 1] if stage > 0 else 0
    return micro_batches * (forward + backward) * element


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a 1F1B schedule: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)
