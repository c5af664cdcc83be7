"""The estimates beside the exact model states: communication volume per step and the pipeline
bubble (activation memory is each family's, `ModelFamily.plan_activations`). These are formulas from
the literature, not measurements; they say so wherever they are printed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends per optimizer step, by collective (ring algorithms: all-reduce moves
    2(N-1)/N of the buffer, reduce-scatter and all-gather (N-1)/N each)."""

    data_parallel: dict[str, int]
    tensor_parallel: int
    pipeline: int
    sequence_parallel: int = 0

    @property
    def total(self) -> int:
        return sum(self.data_parallel.values()) + self.tensor_parallel + self.pipeline + self.sequence_parallel


def data_parallel_bytes(zero_stage: int, elements: int, element: int, dp: int, frozen: int = 0) -> dict[str, int]:
    """ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated
    parameters; ZeRO-3 also all-gathers every parameter in forward and again in backward, the `frozen`
    ones (model.lora's base, which has no gradients) among them."""
    if dp == 1:
        return {}
    volume = elements * element
    ring = (dp - 1) / dp
    if zero_stage == 0:
        return {"all-reduce gradients": int(2 * ring * volume)}
    if zero_stage in (1, 2):
        return {"reduce-scatter gradients": int(ring * volume), "all-gather parameters": int(ring * volume)}
    gathered = 2 * ring * (elements + frozen) * element
    return {"reduce-scatter gradients": int(ring * volume), "all-gather parameters (fwd+bwd)": int(gathered)}


def tensor_parallel_bytes(layers: int, hidden: int, tokens: int, element: int, tensor: int, micro_batches: int) -> int:
    """Megatron's four all-reduces of the hidden states per layer and micro-batch (two forward,
    two backward), plus the embedding's forward all-reduce, each 2(t-1)/t of s*b*h elements."""
    if tensor == 1:
        return 0
    per_all_reduce = 2 * (tensor - 1) / tensor * tokens * hidden * element
    return int(micro_batches * (4 * layers + 1) * per_all_reduce)


def sequence_parallel_bytes(
    layers: int, width: int, tokens: int, element: int, sequence: int, micro_batches: int
) -> int:
    """Ulysses' all-to-alls per layer and micro-batch: the query, keys and values to head slices and
    the attention output back in the forward pass, the same four in the backward pass, each sending
    (SP-1)/SP of this rank's `tokens` x `width` elements (`width`: the four's elements per token)."""
    if sequence == 1:
        return 0
    return int(micro_batches * layers * 2 * (sequence - 1) / sequence * tokens * width * element)


def pipeline_bytes(boundaries: Sequence[int], element: int, stage: int, micro_batches: int) -> int:
    """Point-to-point: a stage's output activations to the next stage and, backward, the gradient
    of its input to the one before, per micro-batch. `boundaries[s]`: the elements stage s sends on."""
    forward = boundaries[stage] if stage < len(boundaries) else 0
    backward = boundaries[stage - 1] if stage > 0 else 0
    return micro_batches * (forward + backward) * element


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """The idle fraction of a 1F1B schedule: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro_batches + stages - 1)
