"""The pipeline timeline: the bubble arithmetic on synthetic schedules, and the chart and events
files. The real two-stage run is in tests/launched/test_timeline_launched.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule

from engine.backends.pipeline_timeline import (
    PipelineEvent,
    RankTimeline,
    bubble_formula,
    idle_fraction,
    replay_in_stage_time,
    save_timeline,
)
from tests.support.schedule import one_f_one_b_order
from tests.support.timeline import assert_chart

FORWARD_S = 1.0  # a backward takes twice as long


def laid_out(order: list[tuple[str, int]], forward_s: float = FORWARD_S, gap_s: float = 0.5) -> list[PipelineEvent]:
    """Passes in `order`, one after the other with `gap_s` between them: their times mean nothing."""
    events, clock = [], 0.0
    for kind, micro_batch in order:
        seconds = forward_s if kind == "forward" else 2 * forward_s
        events.append(PipelineEvent(kind, micro_batch, micro_batch % 2, clock, clock + seconds, seconds))
        clock += seconds + gap_s
    return events


def one_f_one_b(stages: int, micro_batches: int) -> list[list[PipelineEvent]]:
    """A perfect 1F1B step: uniform passes, each as early as the schedule allows."""
    recorded = [laid_out(one_f_one_b_order(stage, stages, micro_batches)) for stage in range(stages)]
    return replay_in_stage_time(recorded)


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (2, 1), (3, 8), (4, 4), (4, 2)])
def test_a_perfect_schedule_has_the_formula_bubble(stages: int, micro_batches: int):
    expected = bubble_formula(stages, micro_batches)
    perfect = one_f_one_b(stages, micro_batches)
    assert idle_fraction(perfect) == pytest.approx(expected)
    recorded = [laid_out(one_f_one_b_order(stage, stages, micro_batches)) for stage in range(stages)]
    assert idle_fraction(replay_in_stage_time(recorded)) == pytest.approx(expected)


def test_an_idle_gap_counts_on_the_wall_clock_only():
    perfect = one_f_one_b(2, 4)
    # Stage 0 stalls for one forward's time before its third forward, and ends that much later.
    stalled = [[*perfect[0][:3], *(shifted(event, FORWARD_S) for event in perfect[0][3:])], perfect[1]]
    assert idle_fraction(stalled) > bubble_formula(2, 4)
    assert idle_fraction(replay_in_stage_time(stalled)) == pytest.approx(bubble_formula(2, 4))


def test_a_slower_stage_raises_the_measured_bubble():
    slow = [laid_out(one_f_one_b_order(0, 2, 4)), laid_out(one_f_one_b_order(1, 2, 4), forward_s=1.5)]
    assert idle_fraction(replay_in_stage_time(slow)) > bubble_formula(2, 4) + 0.05


def test_one_slow_pass_is_not_a_slow_stage():
    """A pass slowed by another process on the machine leaves the stage's median cost as it was."""
    recorded = [laid_out(one_f_one_b_order(stage, 2, 4)) for stage in range(2)]
    slow = recorded[1][3]
    recorded[1][3] = replace(slow, end=slow.start + 3 * slow.seconds, compute_seconds=3 * slow.compute_seconds)
    assert idle_fraction(replay_in_stage_time(recorded)) == pytest.approx(bubble_formula(2, 4))


def test_an_order_that_cannot_run_is_refused():
    backward_first = [laid_out([("backward", 0), ("forward", 0)]), laid_out([("forward", 0), ("backward", 0)])]
    with pytest.raises(ValueError, match="not a pipeline schedule"):
        replay_in_stage_time(backward_first)


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (3, 5), (4, 2)])
def test_the_1f1b_order_is_deepspeeds(stages: int, micro_batches: int):
    for stage in range(stages):
        steps = schedule.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage)
        passes = [command for step in steps for command in step]
        kinds = [
            "forward" if isinstance(command, schedule.ForwardPass) else "backward"
            for command in passes
            if isinstance(command, schedule.ForwardPass | schedule.BackwardPass)
        ]
        assert kinds == [kind for kind, _ in one_f_one_b_order(stage, stages, micro_batches)]


def test_the_chart_and_the_events_are_written(tmp_path: Path):
    timelines = [RankTimeline(stage, stage, 0, 0, events) for stage, events in enumerate(one_f_one_b(2, 4))]
    report = save_timeline(timelines, 4, tmp_path)
    assert report.measured == pytest.approx(0.2) and report.wall_clock == pytest.approx(0.2)
    assert report.describe().startswith(
        "pipeline bubble: measured 0.20 of stage time idle (wall clock 0.20), (p-1)/(m+p-1) = 0.20 (p=2, m=4)"
    )
    assert_chart(report.image)
    assert len(json.loads(report.events.read_text())["ranks"]) == 2


def shifted(event: PipelineEvent, seconds: float) -> PipelineEvent:
    return replace(event, start=event.start + seconds, end=event.end + seconds)
