"""DeepSpeed's 1F1B order worked out independently, to hold recorded pipeline schedules against."""

from __future__ import annotations

from collections.abc import Sequence

from engine.backends.pipeline_timeline import COMPUTE_KINDS, PipelineEvent


def one_f_one_b_order(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """The (kind, micro-batch) order of DeepSpeed's TrainSchedule on `stage`: p-1-stage warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("forward", micro_batch) for micro_batch in range(warmup)]
    for backward in range(micro_batches):
        forward = backward + warmup
        if forward < micro_batches:
            order.append(("forward", forward))
        order.append(("backward", backward))
    return order


def compute_order(events: Sequence[PipelineEvent]) -> list[tuple[str, int]]:
    return [(event.kind, event.micro_batch) for event in events if event.kind in COMPUTE_KINDS]
