"""Benchmark 6: the host cost of the engine's optimizer step under DeepSpeed's two bf16 routes.

On one H200 (benchmark 5) the engine's compiled GPT-2 124M step took 58 ms against the loop's
39 ms, and the whole gap was its optimizer step: bf16 at ZeRO-0 runs DeepSpeed's `FP16_Optimizer`,
whose work is per tensor and which syncs with the device twice. That cost is host time, so it can
be measured without a GPU: the runs here keep GPT-2 124M's 148 tensors but shrink every width,
so compute is negligible and what remains is the per-tensor work a GPU would wait on.

The baseline is `bf16.enabled` (bf16 weights, fp32 master); the engine column is `torch_autocast`
(fp32 weights, FusedAdam on them), the route offered to close that gap (docs/design/precision.md). Both
are the engine's own runs: the mean step of each log window, and the optimizer phase of its
logged step (engine/observability/step_phases.py). Forward and backward are host work here too, as they are
not on a GPU, so the mean step understates what the optimizer's share would be there.
"""

from __future__ import annotations

import statistics

from bench.machine import machine_facts
from bench.results import Panel, Result, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, launch_engine, median, run_overrides

CONFIG = ROOT / "configs" / "gpt2_124m.json"
STEPS, LOG_INTERVAL = 100, 10
# GPT-2 124M's layout (12 blocks, 148 tensors) at width 64 on 32-token windows: its per-tensor host
# work without its compute (benchmark 8 counts on the same model).
SMALL_GPT2 = ["data.type=synthetic", "model.n_embd=64", "model.n_head=4", "model.vocab_size=256", "data.seq_len=32"]
COMMON = [
    *SMALL_GPT2,
    "zero_optimization.stage=0",
    "train_micro_batch_size_per_gpu=1",
    "gradient_accumulation_steps=1",
    "train_batch_size=1",
    "scheduler.params.warmup_num_steps=2",
    # bf16 as written: on one rank the engine would otherwise run it as torch_autocast.
    "trainer.single_rank_fast_path=false",
]
ROUTES = {
    "bf16": ["bf16.enabled=true", "torch_autocast.enabled=false"],
    "torch_autocast": ["bf16.enabled=false", "torch_autocast.enabled=true"],
}
# Row -> what each logged record gives: the window's mean step, and the optimizer phase of its logged
# step (which also counts the logged step's extra work: model-state bytes, the fp32 route's norm).
QUANTITIES = {
    "ms per step": lambda record: record["step_time_s"] * 1e3,
    "optimizer step of a logged step, ms": lambda record: record["time_step_s"] * 1e3,
}


def run(settings: Settings) -> Result:
    overrides = run_overrides(STEPS, LOG_INTERVAL, eval_batches=1, threads=1)
    times: dict[str, dict[str, list[float]]] = {route: {name: [] for name in QUANTITIES} for route in ROUTES}
    for number in range(settings.rounds):
        # Alternating routes within a round, so that a change in the machine's load falls on both.
        for route, sets in ROUTES.items():
            records = launch_engine(CONFIG, [*COMMON, *sets, *overrides], RUNS / "optimizer" / f"{route}-{number}", 1)
            for name, value in QUANTITIES.items():
                # The first window holds start-up and first allocations.
                times[route][name].append(statistics.median(value(record) for record in records[1:]))
        print(
            f"  round {number + 1}/{settings.rounds}: ms per step bf16 {times['bf16']['ms per step'][-1]:.2f}, "
            f"torch_autocast {times['torch_autocast']['ms per step'][-1]:.2f}",
            flush=True,
        )
    numbers = list(range(1, settings.rounds + 1))
    return Result(
        name="optimizer",
        title="Host cost of the optimizer step: bf16 against torch_autocast",
        baseline="bf16",
        method=(
            f"{CONFIG.relative_to(ROOT)} with {', '.join(COMMON)}: GPT-2 124M's 148 tensors at width 64. One process, "
            f"one thread, {STEPS} steps logged every {LOG_INTERVAL}, {settings.rounds} round(s) of one run per route, "
            "alternating. Each run's figure is the median over its windows after the first (the mean step of a "
            "window; the optimizer phase of its logged step, engine/observability/step_phases.py), then the "
            "median over rounds. "
            "The engine column is the torch_autocast route."
        ),
        rows=[compare(name, median(times["bf16"][name]), median(times["torch_autocast"][name])) for name in QUANTITIES],
        panels=[
            Panel(
                title="optimizer: ms per step by round",
                xlabel="round",
                ylabel="ms",
                series={route: (numbers, times[route]["ms per step"]) for route in ROUTES},
            )
        ],
        machine=machine_facts(1),
    )
