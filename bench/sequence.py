"""Benchmark 11: Ulysses sequence parallelism (issue 43): memory per rank against sequence length with
each sequence on one rank (SP 1) and split over two (SP 2), and what the split costs in step time.

A Llama (configs/llama_tiny.json widened to hidden 256, 4 query and 2 key/value heads, 2 layers,
vocabulary 256, fp32, ZeRO-0, one sequence per micro-batch) trains on synthetic tokens under the
`deepspeed` launcher at each length of LENGTHS, on 1 rank and on 2 ranks with
`parallel.sequence_parallel_size=2`, one thread per rank in both, so a rank has the same core either
way. The model is small beside its activations: 24 MiB of model states against hundreds of MiB of
activations at the longest length.

Memory: each rank process's peak RSS (VmHWM, read from /proc by bench/rank_memory.py) over the
whole run. The host holds what a GPU would not (the interpreter, torch, DeepSpeed), so a rank's
activation memory is its peak above the same run's at REFERENCE tokens, whose own activations are
negligible: what grows with the sequence. The figure per rank is the busiest rank's. The goal is the
issue's: at the longest length, SP 2's activation memory per rank within 0.6x of SP 1's.

Speed: a step's time (metrics.jsonl's `step_time_s`), the median over every step after the first.
At equal tokens per rank, SP 2 at length 2L is set against SP 1 at L: each rank then holds L tokens
outside attention, while inside it attends over 2L positions for half the heads, twice the scores of
SP 1 at L, and all-to-alls move its queries, keys, values and outputs. No goal: the ratio is reported.

Plan: `python -m engine plan`'s activation estimate per rank (engine/plan, models/costs.py
`decoder_activations`) beside the measured figure, over the same difference (the plan at the length
less the plan at REFERENCE tokens). It counts the attention scores that SDPA's math kernel holds;
torch's CPU kernel for fp32 is a flash kernel that holds none, so here the plan is an upper bound.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.machine import machine_facts
from bench.rank_memory import watched_launch
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, read_records, run_overrides
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.parallel.process_group import free_port
from engine.plan import plan_run
from engine.preflight import check_data

CONFIG = ROOT / "configs" / "llama_tiny.json"
MODEL = [
    "data.type=synthetic",
    "model.vocab_size=256",
    "model.hidden_size=256",
    "model.intermediate_size=688",
    "model.num_attention_heads=4",
    "train_micro_batch_size_per_gpu=1",
]
DEGREES = (1, 2)  # sequence-parallel degrees, each on as many ranks
LENGTHS = (1024, 2048, 4096, 8192)
REFERENCE = 128  # the length whose peak is each degree's floor: runtime and model states
STEPS = 4
MEMORY_GOAL = Goal("ratio", "<=", 0.6)  # SP 2's activation memory per rank against SP 1's, longest length
MIB = 1 << 20


@dataclass(frozen=True)
class Trial:
    """One launch: each rank's peak RSS, the median step time after the first, the plan's
    activations on its busiest rank."""

    peak_rss: dict[int, int]  # rank -> bytes
    seconds_per_step: float
    planned_activations: int

    @property
    def peak(self) -> int:
        return max(self.peak_rss.values())


def launch_sets(degree: int, length: int, threads: int) -> list[str]:
    """The overrides of one launch: the model, `length` tokens per sequence split `degree` ways."""
    return [
        *MODEL,
        f"data.seq_len={length}",
        f"model.max_position_embeddings={length}",
        f"parallel.sequence_parallel_size={degree}",
        *run_overrides(STEPS, 1, eval_batches=1, threads=threads),
    ]


def planned_activations(sets: list[str], ranks: int) -> int:
    """The planner's activation bytes on the busiest rank of the launch `sets` describe."""
    config = load_config(CONFIG, sets, world_size=ranks, hardware=detect_hardware(local_world_size=ranks))
    return max(rank.activations for rank in plan_run(check_data(config)[0]).ranks)


def trial(degree: int, length: int, threads: int) -> Trial:
    """SP `degree` on as many ranks at `length` tokens, printed."""
    measured = launch(launch_sets(degree, length, threads), degree, RUNS / "sequence" / f"sp{degree}-{length}")
    ranks = ", ".join(f"rank {rank} {peak / MIB:,.0f} MiB" for rank, peak in sorted(measured.peak_rss.items()))
    print(f"  SP {degree}, {length} tokens: {measured.seconds_per_step:.3f} s/step; peak RSS {ranks}", flush=True)
    return measured


def launch(sets: list[str], ranks: int, run_dir: Path) -> Trial:
    """The engine under the `deepspeed` launcher on `ranks` ranks told `sets`, each rank's peak RSS
    watched; its files in a fresh `run_dir`."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh directory: no earlier metrics
    run_dir.mkdir(parents=True)
    command = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    command += ["engine/main.py", "--deepspeed_config", str(CONFIG)]
    command += [arg for value in [*sets, f"trainer.output_dir={run_dir}"] for arg in ("--set", value)]
    peaks = watched_launch(command, run_dir, ranks)
    steps = [record["step_time_s"] for record in read_records(run_dir) if record["step"] > 1]
    return Trial(peaks, statistics.median(steps), planned_activations(sets, ranks))


def run(settings: Settings) -> Result:
    threads = max(1, settings.threads // max(DEGREES))
    trials = {
        (degree, length): trial(degree, length, threads) for degree in DEGREES for length in (REFERENCE, *LENGTHS)
    }
    return sequence_result(trials, machine_facts(settings.threads))


def activations(trials: dict[tuple[int, int], Trial], degree: int, length: int) -> int:
    """The busiest rank's peak above the same degree's at REFERENCE tokens."""
    return trials[degree, length].peak - trials[degree, REFERENCE].peak


def planned(trials: dict[tuple[int, int], Trial], degree: int, length: int) -> int:
    """The plan over the same difference as `activations`."""
    return trials[degree, length].planned_activations - trials[degree, REFERENCE].planned_activations


def sequence_result(trials: dict[tuple[int, int], Trial], machine: dict[str, Any]) -> Result:
    """Rows, longest length first: activation memory per rank (the goal at the longest), peak RSS per
    rank, step time at equal tokens per rank, then measured against planned activations."""
    return Result(
        name="sequence",
        title="Ulysses sequence parallelism: memory per rank against sequence length, SP 1 and SP 2",
        baseline="baseline",
        method=METHOD,
        rows=memory_rows(trials) + speed_rows(trials) + plan_rows(trials),
        panels=[memory_panel(trials)],
        machine=machine,
    )


def memory_rows(trials: dict[tuple[int, int], Trial]) -> list[Row]:
    """Activation memory per rank (the goal at the longest length), then peak RSS per rank, SP 2
    against SP 1, longest length first."""
    one, split = DEGREES
    longest = max(LENGTHS)
    descending = sorted(LENGTHS, reverse=True)
    rows = [
        compare(
            f"activation memory per rank at {length} tokens, MiB: SP {split} vs SP {one}",
            activations(trials, one, length) / MIB,
            activations(trials, split, length) / MIB,
            MEMORY_GOAL if length == longest else None,
        )
        for length in descending
    ]
    return rows + [
        compare(
            f"peak RSS per rank at {length} tokens, MiB: SP {split} vs SP {one}",
            trials[one, length].peak / MIB,
            trials[split, length].peak / MIB,
        )
        for length in descending
    ]


def speed_rows(trials: dict[tuple[int, int], Trial]) -> list[Row]:
    """Step time at equal tokens per rank: SP 2 at 2L against SP 1 at L, where both were run."""
    one, split = DEGREES
    return [
        compare(
            f"seconds per step at {length // split} tokens per rank: SP {split} at {length} vs SP {one} at "
            f"{length // split}",
            trials[one, length // split].seconds_per_step,
            trials[split, length].seconds_per_step,
        )
        for length in sorted(LENGTHS, reverse=True)
        if length // split in LENGTHS
    ]


def plan_rows(trials: dict[tuple[int, int], Trial]) -> list[Row]:
    """Measured against planned activation memory per rank, each degree at each length."""
    return [
        compare(
            f"SP {degree} at {length} tokens: activation memory per rank, MiB: measured vs plan",
            planned(trials, degree, length) / MIB,
            activations(trials, degree, length) / MIB,
        )
        for degree in DEGREES
        for length in sorted(LENGTHS, reverse=True)
    ]


def memory_panel(trials: dict[tuple[int, int], Trial]) -> Panel:
    """Each degree's peak RSS and activations per rank against sequence length."""
    return Panel(
        title="sequence: memory per rank",
        xlabel="sequence length (tokens)",
        ylabel="MiB",
        series={
            **{
                f"SP {degree} peak RSS": (
                    [REFERENCE, *LENGTHS],
                    [trials[degree, length].peak / MIB for length in (REFERENCE, *LENGTHS)],
                )
                for degree in DEGREES
            },
            **{
                f"SP {degree} activations": (
                    list(LENGTHS),
                    [activations(trials, degree, length) / MIB for length in LENGTHS],
                )
                for degree in DEGREES
            },
        },
    )


METHOD = (
    f"{CONFIG.relative_to(ROOT)} widened to hidden 256 (4 query, 2 key/value heads, intermediate 688, "
    f"2 layers, vocabulary 256), fp32, ZeRO-0, one sequence per micro-batch of synthetic tokens, under the "
    f"`deepspeed` launcher, {STEPS} steps, one thread per rank: SP 1 on 1 rank, SP 2 "
    f"(`parallel.sequence_parallel_size=2`, DeepSpeed's Ulysses) on 2 ranks, at {', '.join(map(str, LENGTHS))} "
    f"tokens. Peak RSS: each rank process's VmHWM over the run, read from /proc every 100 ms; a rank's "
    f"activation memory is its peak above the same degree's run at {REFERENCE} tokens (the interpreter, "
    "torch, DeepSpeed and the model states, which a GPU's allocator would not count); per rank means the "
    "busiest rank. Step time: the median `step_time_s` of every step after the first; at equal tokens per "
    "rank SP 2 at 2L is set against SP 1 at L (each rank holds L tokens outside attention; inside it, "
    "2L positions for half the heads, so twice the attention work of SP 1 at L, plus the all-to-alls). "
    "Plan: `python -m engine plan`'s activations per rank less its figure at "
    f"{REFERENCE} tokens; it counts the attention scores that SDPA's math kernel keeps, which torch's "
    "fp32 CPU flash kernel does not, so on this machine it is an upper bound."
)
