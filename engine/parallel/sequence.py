"""Ulysses sequence parallelism: DeepSpeed's own attention (ALST's `UlyssesSPAttentionHF`) in a
transformers model, each rank's slice of every sequence, and the gradient scale that makes the
result equal one process's.

Outside attention each rank of a sequence-parallel group holds T / SP tokens of every sequence;
inside it DeepSpeed's all-to-alls give each rank the whole sequence for heads / SP of the heads.

What DeepSpeed leaves to the caller, done here:

* The slices. Every rank of the group reads the same micro-batch (its data replica's) and keeps its
  own slice of the sequence: no collective, and the data order is the data-parallel layout's, so
  a run resumes or reshapes to any SP degree on the same samples. DeepSpeed's
  `UlyssesSPDataLoaderAdapter` instead has each rank read its own batches and deals them out
  across the group in turns (an all-gather per batch), which ties the data order to SP. Labels
  arrive already shifted (data/), so a slice of the labels is the slice's targets.
* The loss. Each rank's loss is its slice's summed target loss over the global batch's divisor
  (engine/backends/token_mean.py), so the group's gradients add up to the full sequence's. The
  tutorial's autograd all-gather of the losses makes every rank's gradient SP times its share.
* The reduction's scale. DeepSpeed 0.19.8 divides the gradients reduced over the SP x DP ranks by
  DP in ZeRO 0-2 and in ZeRO-3's contiguous path, but by SP x DP in ZeRO-3's reduce-scatter path
  (`stage3.__avg_scatter_grads`, through `reduce_scatter_coalesced`). Under ZeRO-3 (reduce-scatter
  required by engine/config/rules.py) the loss goes to backward multiplied by SP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.attention import SHARD_POSITIONS, ULYSSES_SDPA
from models.labels import IGNORE_INDEX


@dataclass(frozen=True)
class SequenceShards:
    """This rank's place in its sequence-parallel group and what the backend does with it."""

    size: int  # parallel.sequence_parallel_size
    rank: int  # this rank's slice of every sequence
    data_group: dist.ProcessGroup  # every rank that holds a copy of the weights: DP x SP
    groups: Any  # DeepSpeed's sequence-parallel state, the `mpu` of `deepspeed.initialize`
    grad_scale: float  # what each loss is multiplied by before backward (see the module docstring)

    def shard(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slice of every sequence in `batch`, with the positions the slice's tokens have
        in the whole sequence (DeepSpeed's attention gathers them back). Batches of conversations,
        padded to their longest, are padded on to a multiple of SP with ignored targets, which the
        causal attention of the tokens before them never sees."""
        length = batch["input_ids"].shape[1]
        padded = math.ceil(length / self.size) * self.size
        if padded != length:
            batch = _pad(batch, padded - length)
        width = padded // self.size
        window = slice(self.rank * width, (self.rank + 1) * width)
        positions = torch.arange(padded, device=batch["input_ids"].device).expand(batch["input_ids"].shape[0], -1)
        shard = {key: value[:, window] for key, value in batch.items()}
        shard[SHARD_POSITIONS] = positions[:, window]
        return shard


def _pad(batch: dict[str, torch.Tensor], extra: int) -> dict[str, torch.Tensor]:
    return {
        key: torch.nn.functional.pad(value, (0, extra), value=IGNORE_INDEX if key == "labels" else 0)
        for key, value in batch.items()
    }


class UlyssesGroups:
    """DeepSpeed's sequence-parallel state (`parallel_state_sp`) as the `mpu` of
    `deepspeed.initialize`, with the one answer it lacks: the tensor-parallel degree, 1.

    Asked for it, DeepSpeed 0.19.8 falls back on `get_model_parallel_world_size`, which
    parallel_state_sp aliases to the sequence-parallel size: every checkpoint then records SP as
    its tensor-parallel degree (`_checkpoint_parallel_metadata`), ds_to_universal takes the ranks'
    files for tensor shards, and a universal load (base_optimizer.py, which asks by name) fails."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


def enable_ulysses(model: torch.nn.Module, size: int, micro_batch_size: int, zero_stage: int) -> SequenceShards:
    """Route `model`'s attention through DeepSpeed's Ulysses for groups of `size` adjacent ranks,
    creating DeepSpeed's sequence-parallel groups; returns this rank's shards.

    DeepSpeed swaps the attention function registered under the model's attention name for its
    wrapper, process-wide and for good. The model is moved to a name of the engine's own
    (`models.attention.ULYSSES_SDPA`, plain SDPA), so no other model in the process, nor a later
    one loaded from the export, runs through it."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # Plain SDPA, causal over the whole gathered sequence (Ulysses hands it no mask).
    AttentionInterface.register(ULYSSES_SDPA, sdpa_attention_forward)
    model.set_attn_implementation(ULYSSES_SDPA)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=ULYSSES_SDPA,
        sequence_parallel_size=size,
        micro_batch_size=micro_batch_size,
        # Conversations are padded to each micro-batch's longest: the length may change per batch.
        seq_length_is_variable=True,
    )
    return SequenceShards(
        size=size,
        rank=mpu.get_sequence_parallel_rank(),
        data_group=mpu.get_sequence_data_parallel_group(),
        groups=UlyssesGroups(mpu),
        grad_scale=float(size) if zero_stage == 3 else 1.0,
    )
