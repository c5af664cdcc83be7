"""Benchmarks 1 and 2: the engine's training throughput against a minimal hand-written PyTorch
loop and against a minimal raw DeepSpeed script, one process, ZeRO-0, fp32.

Both run benchmark 3's config (configs/shakespeare_char.json), so its speed goal compares the
same shapes. The engine's overhead over raw DeepSpeed is what the engine adds; over plain PyTorch
it also includes what DeepSpeed itself adds."""

from __future__ import annotations

from bench.results import Goal, Panel, Result, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, median, rounds, run_overrides

CONFIG = ROOT / "configs" / "shakespeare_char.json"
GOAL = Goal("ratio", ">=", 0.97)


def versus_torch(settings: Settings) -> Result:
    return _versus("overhead", "torch", "PyTorch loop", "Engine overhead over a minimal PyTorch loop", settings)


def versus_deepspeed(settings: Settings) -> Result:
    title = "Engine overhead over a minimal DeepSpeed script"
    return _versus("deepspeed", "deepspeed", "raw DeepSpeed", title, settings)


def _versus(name: str, kind: str, label: str, title: str, settings: Settings) -> Result:
    overrides = run_overrides(settings.steps, settings.log_interval, eval_batches=1, threads=settings.threads)
    pairs = rounds(kind, CONFIG, overrides, settings.rounds, RUNS / name, name)
    numbers = list(range(1, settings.rounds + 1))
    return Result(
        name=name,
        title=title,
        baseline=label,
        method=(
            f"{CONFIG.relative_to(ROOT)} (benchmark 3's shapes), one process, {settings.threads} threads. "
            f"{settings.rounds} round(s), each a fresh process in which the engine and the baseline alternate "
            f"window by window for {settings.steps} steps (bench/paired.py), the engine logging every "
            f"{settings.log_interval}. "
            f"Speed: the median {settings.log_interval}-step window after the first; ratio: the median of the "
            "per-window ratios, then the median over rounds."
        ),
        rows=[
            compare(
                "tokens/s",
                median([p.baseline.tokens_per_s for p in pairs]),
                median([p.engine.tokens_per_s for p in pairs]),
                GOAL,
                ratio=median([p.ratio for p in pairs]),
            ),
            compare(
                "ms per step",
                median([p.baseline.seconds_per_step * 1e3 for p in pairs]),
                median([p.engine.seconds_per_step * 1e3 for p in pairs]),
            ),
        ],
        panels=[
            Panel(
                title=f"{name}: tokens/s per round",
                xlabel="round",
                ylabel="tokens/s",
                series={
                    label: (numbers, [p.baseline.tokens_per_s for p in pairs]),
                    "engine": (numbers, [p.engine.tokens_per_s for p in pairs]),
                },
                goal_line=None,
            )
        ],
        machine=pairs[0].machine,
    )
