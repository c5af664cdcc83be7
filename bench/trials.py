"""Timed trials of the engine and of a baseline, each in a fresh process, interleaved.

Every side runs the same command-line config with the same overrides and writes the same
`metrics.jsonl` (the engine its own, the baselines bench/baseline.py's). A trial's speed is its
fastest log window after the first, so start-up, the first steps' allocations and any warm-up are
excluded on both sides alike, and the per-log work of the engine is spread over `log_interval`
steps as in a real run. Sides alternate within each round and the order flips
every round (AB BA AB ...), so drift in the machine's load hits both sides alike; benchmarks
report medians.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "bench"


@dataclass(frozen=True)
class Trial:
    """One process's steady-state speed, its logged training losses and its final evaluation."""

    seconds_per_step: float
    tokens_per_s: float
    losses: list[tuple[int, float]]
    eval_loss: float | None


Side = Callable[[Path], Trial]  # runs one trial writing into the given directory


def run_overrides(steps: int, log_interval: int, eval_batches: int, threads: int) -> list[str]:
    """What every side of a trial is told, on top of the benchmark's config. Every side sets its
    thread count from `trainer.threads_per_rank`, as the engine does."""
    return [
        f"trainer.max_steps={steps}",
        f"trainer.log_interval={log_interval}",
        "trainer.eval_interval=0",
        f"trainer.eval_batches={eval_batches}",
        f"trainer.threads_per_rank={threads}",
        "trainer.export=false",
        "trainer.plots=false",
        "trainer.progress_bar=false",
        "trainer.sample_tokens=0",
    ]


def engine_side(config: Path, overrides: list[str]) -> Side:
    """The real engine, started as users start one process: `python engine/main.py`."""

    def trial(run_dir: Path) -> Trial:
        return _run([sys.executable, "engine/main.py", "--deepspeed_config", str(config)], overrides, run_dir)

    return trial


def baseline_side(kind: str, config: Path, overrides: list[str]) -> Side:
    """A bench/baseline.py loop (`kind` "torch" or "deepspeed") on the same config and overrides."""

    def trial(run_dir: Path) -> Trial:
        return _run([sys.executable, "-m", "bench.baseline", kind, "--config", str(config)], overrides, run_dir)

    return trial


def _run(command: list[str], overrides: list[str], run_dir: Path) -> Trial:
    # A fresh directory: the engine would otherwise find the last trial's metrics and checkpoints.
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = command + [arg for value in [*overrides, f"trainer.output_dir={run_dir}"] for arg in ("--set", value)]
    log = run_dir / "trial.log"
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {code}; log {log}:\n{tail}")
    return read_trial(run_dir)


def read_trial(run_dir: Path) -> Trial:
    """Speed from metrics.jsonl: the fastest window after the first (which holds start-up).

    Each window is `log_interval` steps including one logged step, so the engine's logging is in
    every window. The fastest, as `timeit` takes the minimum: on a shared machine another job's
    burst slows some windows several-fold (threads of two processes fighting over the same cores),
    which is noise about the machine, not about the loop."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(records) < 2:
        raise RuntimeError(f"{run_dir}: need at least two log records to time steady steps; run more steps")
    doc = json.loads((run_dir / "resolved_config.json").read_text())
    tokens_per_step = doc["train_batch_size"] * doc["data"]["seq_len"]
    fastest = min(record["step_time_s"] for record in records[1:])
    return Trial(
        seconds_per_step=fastest,
        tokens_per_s=tokens_per_step / fastest,
        losses=[(r["step"], r["loss"]) for r in records],
        eval_loss=records[-1].get("eval_loss"),
    )


def interleave(sides: dict[str, Side], rounds: int, run_dir: Path) -> dict[str, list[Trial]]:
    """`rounds` trials of every side, alternating, the order reversed every other round."""
    trials: dict[str, list[Trial]] = {name: [] for name in sides}
    for number in range(rounds):
        order = list(sides) if number % 2 == 0 else list(reversed(sides))
        for name in order:
            trial = sides[name](run_dir / f"{name.lower().replace(' ', '-')}-{number}")
            trials[name].append(trial)
            print(f"  round {number + 1}/{rounds} {name}: {trial.seconds_per_step * 1e3:.2f} ms/step", flush=True)
    return trials


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired_ratio(engine: list[Trial], baseline: list[Trial]) -> float:
    """Median over rounds of engine / baseline throughput, each pair measured back to back."""
    return median([e.tokens_per_s / b.tokens_per_s for e, b in zip(engine, baseline, strict=True)])
