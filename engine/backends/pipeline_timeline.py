"""The pipeline's actual schedule: when each stage ran each micro-batch's forward and backward in the
last training step, drawn as a Gantt chart, with the measured bubble next to (p-1)/(m+p-1).

The pipeline backend records every instruction DeepSpeed's engine executes; here the stages'
records are gathered to rank 0, put on one clock, measured and drawn. Two idle fractions are
reported, both `1 - busy / (p x span)`: the *measured bubble, in stage time* (the recorded order
replayed with each stage's own pass costs, so machine noise and clock skew do not enter: what the
formula describes) and the *wall-clock idle fraction* of the recorded times themselves. Why both,
and how a pass's cost is taken: docs/design/observability.md, "The pipeline bubble is measured by replaying the
recorded schedule in stage time".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import fmean, median

import torch.distributed as dist

COMPUTE_KINDS = ("forward", "backward")
# What each instruction kind counts as in a step's time breakdown (metrics' time_<phase>_s).
PHASE_OF_KIND = {
    "load_micro_batch": "data",
    "forward": "forward",
    "backward": "backward",
    "send_activation": "communication",
    "recv_activation": "communication",
    "send_grad": "communication",
    "recv_grad": "communication",
    "reduce_tied_grads": "step",
    "reduce_grads": "step",
    "optimizer_step": "step",
}
PHASES = ("data", "forward", "backward", "communication", "step")
IMAGE_NAME, EVENTS_NAME = "pipeline_timeline.png", "pipeline_timeline.json"


@dataclass(frozen=True)
class PipelineEvent:
    """One executed pipeline instruction. `micro_batch` is the micro-batch's index within the step
    and `buffer` the pipeline buffer slot DeepSpeed used for it; both None for the step-wide
    reductions and the optimizer step. `start` and `end` are seconds on some clock (see
    `gather_timelines`); `compute_seconds` is the work it took: the process's CPU time on a CPU (on a
    shared machine wall time also counts the time other processes held the core), the synchronised
    wall time on a GPU."""

    kind: str
    micro_batch: int | None
    buffer: int | None
    start: float
    end: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def step_breakdown(events: Sequence[PipelineEvent]) -> dict[str, float]:
    """Seconds of one stage's step spent in each phase of `PHASES`."""
    seconds = dict.fromkeys(PHASES, 0.0)
    for event in events:
        seconds[PHASE_OF_KIND[event.kind]] += event.seconds
    return seconds


def bubble_formula(stages: int, micro_batches: int) -> float:
    return (stages - 1) / (micro_batches + stages - 1)


def idle_fraction(stages: Sequence[Sequence[PipelineEvent]]) -> float:
    """1 - busy / (p x span): busy is the forward and backward time of all p stages, span the time
    from the first forward to the last backward on any stage (so the stages must share a clock)."""
    compute = [event for events in stages for event in events if event.kind in COMPUTE_KINDS]
    span = max(event.end for event in compute) - min(event.start for event in compute)
    return 1.0 - sum(event.seconds for event in compute) / (len(stages) * span)


def pass_costs(stages: Sequence[Sequence[PipelineEvent]]) -> list[dict[str, float]]:
    """Each stage's median forward and median backward compute seconds."""
    return [
        {kind: median(event.compute_seconds for event in events if event.kind == kind) for kind in COMPUTE_KINDS}
        for events in stages
    ]


def pooled_costs(samples: Sequence[dict[str, list[float]]]) -> list[dict[str, float]]:
    """Each stage's fastest forward and fastest backward over every recorded step: as `timeit`
    reports the minimum, the fastest pass is the stage's own cost, the others that cost plus
    whatever the machine added (on two vCPUs of one core, the other stage computing beside it)."""
    return [{kind: min(stage[kind]) for kind in COMPUTE_KINDS} for stage in samples]


def replay_in_stage_time(
    stages: Sequence[Sequence[PipelineEvent]], costs: Sequence[dict[str, float]] | None = None
) -> list[list[PipelineEvent]]:
    """The stages' recorded forward/backward order, re-timed with each stage's forward and backward
    compute seconds (`costs`; by default the medians of the recorded passes, `pass_costs`), every
    pass as early as its stage and its input allow, everything else free.

    Stage s's forward of micro-batch i needs stage s-1's; its backward needs stage s+1's. Raises
    ValueError when the recorded orders cannot all run (not a pipeline schedule)."""
    compute = [[event for event in events if event.kind in COMPUTE_KINDS] for events in stages]
    cost = pass_costs(stages) if costs is None else costs
    finished: dict[tuple[int, str, int], float] = {}
    replayed: list[list[PipelineEvent]] = [[] for _ in compute]
    free_at = [0.0] * len(compute)
    while sum(map(len, replayed)) < sum(map(len, compute)):
        progressed = False
        for stage, events in enumerate(compute):
            while len(replayed[stage]) < len(events):
                event = events[len(replayed[stage])]
                source = stage - 1 if event.kind == "forward" else stage + 1
                ready = 0.0
                if 0 <= source < len(compute):
                    if (source, event.kind, event.micro_batch) not in finished:
                        break
                    ready = finished[source, event.kind, event.micro_batch]
                start = max(free_at[stage], ready)
                free_at[stage] = start + cost[stage][event.kind]
                finished[stage, event.kind, event.micro_batch] = free_at[stage]
                replayed[stage].append(replace(event, start=start, end=free_at[stage]))
                progressed = True
        if not progressed:
            raise ValueError("the recorded forward/backward orders deadlock: not a pipeline schedule")
    return replayed


@dataclass(frozen=True)
class TimelineReport:
    stages: int
    micro_batches: int
    measured: float  # idle fraction in stage time (module docstring)
    wall_clock: float  # idle fraction of the recorded times
    formula: float
    image: Path
    events: Path

    def describe(self) -> str:
        return (
            f"pipeline bubble: measured {self.measured:.2f} of stage time idle (wall clock {self.wall_clock:.2f}), "
            f"(p-1)/(m+p-1) = {self.formula:.2f} (p={self.stages}, m={self.micro_batches}); "
            f"Gantt chart {self.image}"
        )


@dataclass(frozen=True)
class RankTimeline:
    """One rank's events of the last step, on the common clock, with its place in the layout."""

    rank: int
    stage: int
    data_rank: int
    tensor_rank: int
    events: list[PipelineEvent]
    # forward/backward compute seconds of every recorded step, for the stage's pass costs
    samples: dict[str, list[float]] = field(default_factory=dict)


def gather_timelines(mine: RankTimeline) -> list[RankTimeline] | None:
    """Collective: every rank's last-step events, on rank 0 (None elsewhere), on rank 0's clock.

    The clocks are put together after the fact rather than by a barrier before every step: right
    after one barrier every rank reads its own monotonic clock, and the differences between those
    readings are the offsets between the ranks' clocks (to within the barrier's release skew, one
    message latency; hosts' clocks drift by parts per million, nothing over one run's length). That
    works across hosts, costs the training steps nothing, and only the wall-clock figures and the
    chart depend on it: the measured bubble uses durations and order alone."""
    dist.barrier()
    now = time.perf_counter()
    gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((now, mine), gathered, dst=0)
    if gathered is None:
        return None
    origin = gathered[0][0]
    return [
        replace(timeline, events=[_shifted(event, origin - clock) for event in timeline.events])
        for clock, timeline in gathered
    ]


def _shifted(event: PipelineEvent, seconds: float) -> PipelineEvent:
    return replace(event, start=event.start + seconds, end=event.end + seconds)


def representative_stages(timelines: Sequence[RankTimeline]) -> list[RankTimeline]:
    """Each stage's timeline on data replica 0, tensor shard 0: every replica and shard runs the same
    schedule, so one pipeline stands for all of them in the chart and the bubble."""
    chosen = {t.stage: t for t in timelines if t.data_rank == 0 and t.tensor_rank == 0}
    return [chosen[stage] for stage in sorted(chosen)]


def save_timeline(timelines: Sequence[RankTimeline], micro_batches: int, output_dir: Path) -> TimelineReport:
    """Write every rank's events (seconds from the step's first instruction) and the Gantt chart of
    the representative pipeline to `output_dir`; return the bubble figures."""
    representatives = representative_stages(timelines)
    stages = [timeline.events for timeline in representatives]
    samples = [timeline.samples for timeline in representatives]
    costs = pooled_costs(samples) if all(samples) else pass_costs(stages)
    replayed = replay_in_stage_time(stages, costs)
    report = TimelineReport(
        stages=len(stages),
        micro_batches=micro_batches,
        measured=idle_fraction(replayed),
        wall_clock=idle_fraction(stages),
        formula=bubble_formula(len(stages), micro_batches),
        image=output_dir / IMAGE_NAME,
        events=output_dir / EVENTS_NAME,
    )
    origin = min(event.start for timeline in timelines for event in timeline.events)
    document = {
        "stages": report.stages,
        "micro_batches": report.micro_batches,
        "measured_bubble": report.measured,
        "wall_clock_bubble": report.wall_clock,
        "formula_bubble": report.formula,
        "ranks": [
            {
                **{key: value for key, value in asdict(timeline).items() if key != "events"},
                "events": [
                    {**asdict(event), "start": event.start - origin, "end": event.end - origin}
                    for event in timeline.events
                ],
            }
            for timeline in timelines
        ],
    }
    report.events.write_text(json.dumps(document, indent=1) + "\n")
    draw_gantt(stages, replayed, costs, report)
    return report


_COLOURS = {"forward": "#4c72b0", "backward": "#55a868"}
_OTHER_COLOUR, _IDLE_COLOUR = "#9a9a9a", "#f4cccc"


def draw_gantt(
    stages: Sequence[Sequence[PipelineEvent]],
    replayed: Sequence[Sequence[PipelineEvent]],
    costs: Sequence[dict[str, float]],
    report: TimelineReport,
) -> None:
    """Two charts, one row per stage: the step as recorded (seconds; sends, receives, loads and the
    optimizer step as thin grey bars) and as replayed in stage time (one unit: the stages' mean
    forward plus backward). Idle time is the red background left uncovered."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(event.start for events in stages for event in events if event.kind in COMPUTE_KINDS)
    unit = fmean(sum(stage.values()) for stage in costs)
    figure, (recorded_axes, replay_axes) = plt.subplots(2, 1, figsize=(12, 1.6 * len(stages) + 2.5))
    _draw_rows(recorded_axes, stages, origin, 1.0)
    recorded_axes.set_title(f"recorded, wall clock: {report.wall_clock:.2f} idle", fontsize=10)
    recorded_axes.set_xlabel("seconds since the first forward")
    _draw_rows(replay_axes, replayed, 0.0, unit)
    replay_axes.set_title(f"replayed in stage time: {report.measured:.2f} idle", fontsize=10)
    replay_axes.set_xlabel("stage time (the stages' mean forward + backward = 1)")
    figure.suptitle(
        f"pipeline schedule, p={report.stages} stages, m={report.micro_batches} micro-batches; "
        f"(p-1)/(m+p-1) = {report.formula:.2f}"
    )
    figure.tight_layout()
    figure.savefig(report.image, dpi=100)
    plt.close(figure)


def _draw_rows(axes, stages: Sequence[Sequence[PipelineEvent]], origin: float, unit: float) -> None:
    compute = [event for events in stages for event in events if event.kind in COMPUTE_KINDS]
    first, last = min(event.start for event in compute), max(event.end for event in compute)
    for row, events in enumerate(stages):
        axes.broken_barh([((first - origin) / unit, (last - first) / unit)], (row - 0.4, 0.8), color=_IDLE_COLOUR)
        for event in events:
            left, width = (event.start - origin) / unit, event.seconds / unit
            if event.kind in COMPUTE_KINDS:
                axes.broken_barh([(left, width)], (row - 0.4, 0.8), color=_COLOURS[event.kind], edgecolor="white")
                label = f"{event.kind[0].upper()}{event.micro_batch}"
                axes.text(left + width / 2, row, label, ha="center", va="center", color="white", fontsize=8)
            else:
                axes.broken_barh([(left, width)], (row - 0.1, 0.2), color=_OTHER_COLOUR)
    axes.set_yticks(range(len(stages)), [f"stage {stage}" for stage in range(len(stages))])
    axes.set_ylim(len(stages) - 0.5, -0.5)


def write_pipeline_timeline(
    mine: RankTimeline, micro_batches: int, output_dir: Path, write_line: Callable[[str], None]
) -> None:
    """Collective, once at the end of training: rank 0 writes the last step's timeline, its chart
    and one line with the measured bubble against (p-1)/(m+p-1)."""
    timelines = gather_timelines(mine)
    if timelines is None:
        return
    if not any(timeline.events for timeline in timelines):
        write_line("pipeline timeline: no training step ran in this process, nothing to draw")
        return
    report = save_timeline(timelines, micro_batches, output_dir)
    write_line(report.describe())
