"""A step's loss as the mean over its target tokens: the tokens whose label is not IGNORE_INDEX, in
every micro-batch of the step's gradient accumulation on every data-parallel rank.

Averaging each micro-batch's own mean instead weights a token by one over its micro-batch's count of
targets. Where prompts and padding are masked (chat and instruction data) micro-batches hold
different counts, and that result changes with the micro-batch size, the accumulation steps and the
number of ranks: the gradient accumulation bug transformers fixed in 2024 by dividing summed losses
by `num_items_in_batch`. Here each micro-batch's summed token loss is divided by the global batch's
mean count of targets per micro-batch, N / (accumulation x data-parallel ranks). The backward divides
by the accumulation steps (DeepSpeed's `engine.backward`, or the accelerate backend itself) and the
gradient reduction averages over the data-parallel ranks, which leaves exactly the gradient of the
global batch's summed loss over N; each rank's mean micro-batch loss, averaged over the ranks (what
the loop logs), is that global mean too.

Where every label is a target (text, token files, images) every micro-batch holds the same count,
its own mean is already the global one, and a step needs neither the count nor its collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.labels import IGNORE_INDEX


@dataclass(frozen=True)
class TargetCount:
    """The divisor of each micro-batch's summed token loss, counted afresh at every step."""

    accumulation: int  # micro-batches per rank and step
    data_parallel: int  # ranks that read different micro-batches
    # The ranks whose targets make up the global batch (None: the default group): the data-parallel
    # ranks, and under sequence parallelism each one's sequence shards, which count their own slices.
    group: dist.ProcessGroup | None
    sequence: int = 1  # sequence shards per data-parallel rank

    def divisor(self, micro_batches: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The global batch's target tokens per micro-batch, on the device: one all-reduce of one
        integer over the data-parallel group, and no host read."""
        targets = torch.stack([(batch["labels"] != IGNORE_INDEX).sum() for batch in micro_batches]).sum()
        if self.data_parallel * self.sequence > 1:
            dist.all_reduce(targets, group=self.group)
        # A step without a single target (every answer truncated away) trains on nothing, not on 0 / 0.
        return (targets.clamp(min=1).double() / (self.accumulation * self.data_parallel)).float()
