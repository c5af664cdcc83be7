"""Benchmarks 1 and 2: the engine's training throughput against a minimal hand-written PyTorch
loop and against a minimal raw DeepSpeed script, one process, ZeRO-0, fp32.

Both run benchmark 3's config (configs/shakespeare_char.json), so its speed goal compares the
same shapes. The engine's overhead over raw DeepSpeed is what the engine adds; over plain PyTorch
it also includes what DeepSpeed itself adds."""

from __future__ import annotations

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, baseline_side, engine_side, interleave, median, paired_ratio, run_overrides

CONFIG = ROOT / "configs" / "shakespeare_char.json"
GOAL = Goal("ratio", ">=", 0.97)


def versus_torch(settings: Settings) -> Result:
    return _versus("overhead", "torch", "PyTorch loop", "Engine overhead over a minimal PyTorch loop", settings)


def versus_deepspeed(settings: Settings) -> Result:
    title = "Engine overhead over a minimal DeepSpeed script"
    return _versus("deepspeed", "deepspeed", "raw DeepSpeed", title, settings)


def _versus(name: str, kind: str, label: str, title: str, settings: Settings) -> Result:
    overrides = run_overrides(settings.steps, settings.log_interval, eval_batches=1, threads=settings.threads)
    sides = {
        label: baseline_side(kind, CONFIG, overrides),
        "engine": engine_side(CONFIG, overrides),
    }
    trials = interleave(sides, settings.rounds, RUNS / name)
    baseline, engine = trials[label], trials["engine"]
    rounds = list(range(1, settings.rounds + 1))
    return Result(
        name=name,
        title=title,
        baseline=label,
        method=(
            f"{CONFIG.relative_to(ROOT)} (benchmark 3's shapes), one process, {settings.threads} threads per side. "
            f"{settings.rounds} interleaved round(s) (order flipped every round) of "
            f"{settings.steps} steps per side in fresh processes, logged every {settings.log_interval}; a trial's "
            "speed is its fastest log window after the first (each window includes one logged step). Medians "
            "over rounds; the ratio is the median of the per-round ratios."
        ),
        rows=[
            compare(
                "tokens/s",
                median([t.tokens_per_s for t in baseline]),
                median([t.tokens_per_s for t in engine]),
                GOAL,
                ratio=paired_ratio(engine, baseline),
            ),
            compare(
                "ms per step",
                median([t.seconds_per_step * 1e3 for t in baseline]),
                median([t.seconds_per_step * 1e3 for t in engine]),
            ),
        ],
        panels=[
            Panel(
                title=f"{name}: tokens/s per round",
                xlabel="round",
                ylabel="tokens/s",
                series={side: (rounds, [t.tokens_per_s for t in trials[side]]) for side in trials},
            )
        ],
        machine=machine_facts(settings.threads),
    )
