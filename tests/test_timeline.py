"""The pipeline timeline: the bubble arithmetic on synthetic schedules, the chart and events files, and
one real two-stage run whose recorded schedule is DeepSpeed's 1F1B with the bubble the formula gives."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from deepspeed.runtime.pipe import schedule
from PIL import Image

from engine.timeline import (
    PipelineEvent,
    RankTimeline,
    bubble_formula,
    idle_fraction,
    replay_in_stage_time,
    save_timeline,
)
from tests.support.launch import launch
from tests.support.monitor import MONITORS, assert_monitor_holds
from tests.support.schedule import compute_order, one_f_one_b_order

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


def assert_chart(path: Path) -> None:
    with Image.open(path) as image:
        image.load()
        assert image.width > 100 and image.height > 100


# Two stages of two blocks each (partition by block), 512 tokens per micro-batch: a pass takes about
# 0.1 s on one CPU core, a hundred times a send between the stages. Three steps, the last one recorded.
PP2_M4 = {
    "parallel.pipeline_parallel_size": 2,
    "parallel.pipeline_partition_method": "type",
    "gradient_accumulation_steps": 4,
    "train_micro_batch_size_per_gpu": 4,
    "model.n_layer": 4,
    "model.n_embd": 256,
    "model.n_head": 4,
    "model.n_positions": 128,
    "trainer.max_steps": 4,
    "trainer.export": False,
}


@pytest.mark.launch
def test_a_two_stage_run_records_1f1b_with_the_formula_bubble(tmp_path: Path):
    # The monitors ride along: DeepSpeed's pipeline engine must log the engine's records, evaluation included.
    run = launch("configs/tiny_gpt.json", {**PP2_M4, **MONITORS}, tmp_path / "run", nproc=2)
    assert_chart(run.output_dir / "pipeline_timeline.png")
    document = json.loads((run.output_dir / "pipeline_timeline.json").read_text())
    for timeline in document["ranks"]:
        events = [PipelineEvent(**event) for event in timeline["events"]]
        assert compute_order(events) == one_f_one_b_order(timeline["stage"], 2, 4)
    assert sorted(timeline["stage"] for timeline in document["ranks"]) == [0, 1]
    assert document["measured_bubble"] == pytest.approx(0.2, rel=0.1), document["measured_bubble"]
    assert "pipeline bubble: measured" in run.stdout and "(p-1)/(m+p-1) = 0.20 (p=2, m=4)" in run.stdout
    assert {"time_forward_s", "time_backward_s", "time_communication_s"} <= run.records[-1].keys()
    assert_monitor_holds(run.output_dir, "loss")
    assert_monitor_holds(run.output_dir, "eval_loss")
