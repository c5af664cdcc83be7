"""Trials: the engine paired with a baseline in one fresh process (bench/paired.py), and the engine
alone under the `deepspeed` launcher.

A paired trial alternates windows of `log_interval` steps between the sides; each engine window
holds one logged step, so the engine's logging is charged as in a real run. The first window of
each side (start-up, first allocations, compilation) is dropped. A side's speed is its median
window, and the trial's ratio is the median of the ratios of back-to-back windows.
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
from typing import Any

from bench.paired import PAIRED
from engine.observability import metrics
from engine.parallel.process_group import free_port

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs" / "bench"


@dataclass(frozen=True)
class Side:
    """One side's steady speed in a trial, its logged training losses and its final evaluation."""

    seconds_per_step: float
    tokens_per_s: float
    losses: list[tuple[int, float]]
    eval_loss: float | None


@dataclass(frozen=True)
class Pair:
    engine: Side
    baseline: Side
    ratio: float  # engine / baseline throughput: the median over windows of the paired ratios
    machine: dict[str, Any]  # bench.machine.machine_facts of the process that ran the trial


def run_overrides(steps: int, log_interval: int, eval_batches: int, threads: int) -> list[str]:
    """What every trial is told on top of its benchmark's config (the thread count is also the
    baseline's: it shares the engine's process)."""
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


def paired_trial(kind: str, config: Path, overrides: list[str], run_dir: Path) -> Pair:
    """The engine and the `kind` baseline ("torch" or "deepspeed"), step for step in one process."""
    run_logged([sys.executable, "-m", "bench.paired", kind, "--config", str(config)], overrides, run_dir)
    return read_pair(run_dir)


def read_pair(run_dir: Path) -> Pair:
    """A paired trial's two sides from what it wrote to `run_dir`: kept apart from running it so that
    trials measured on another machine (a lent GPU) can be read here."""
    paired = json.loads((run_dir / PAIRED).read_text())
    records = read_records(run_dir)
    doc = json.loads((run_dir / "resolved_config.json").read_text())
    tokens_per_step, window = doc["train_batch_size"] * doc["data"]["seq_len"], paired["window"]
    # Engine window k and baseline window k ran back to back; the first of each (start-up) is dropped.
    engine, baseline = paired["engine_windows"], paired["baseline_windows"][1 : len(paired["engine_windows"]) + 1]
    if not engine:
        raise RuntimeError(f"{run_dir}: too few steps to time after the first window; run more steps")

    def side(windows: list[float], losses: list, eval_loss: float | None) -> Side:
        seconds = statistics.median(windows) / window
        return Side(seconds, tokens_per_step / seconds, [tuple(loss) for loss in losses], eval_loss)

    return Pair(
        engine=side(engine, [(r["step"], r["loss"]) for r in records], records[-1].get("eval_loss")),
        baseline=side(baseline, paired["baseline_losses"], paired["baseline_eval_loss"]),
        ratio=statistics.median(b / e for e, b in zip(engine, baseline, strict=True)),
        machine=paired["machine"],
    )


def launch_engine(config: Path, overrides: list[str], run_dir: Path, processes: int) -> list[dict]:
    """The engine under the `deepspeed` launcher with `processes` local ranks; its metrics records."""
    launcher = ["deepspeed", "--num_gpus", str(processes), "--master_port", str(free_port())]
    run_logged([*launcher, "engine/main.py", "--deepspeed_config", str(config)], overrides, run_dir)
    return read_records(run_dir)


def run_logged(command: list[str], overrides: list[str], run_dir: Path) -> None:
    """`command` with `overrides` and the output directory as `--set` arguments, in a fresh `run_dir`,
    its output in `run_dir/trial.log`; raises with the log's tail if it fails."""
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


def read_records(run_dir: Path) -> list[dict]:
    return metrics.read_records(run_dir / "metrics.jsonl")


def rounds(
    kind: str,
    config: Path,
    overrides: list[str],
    count: int,
    run_dir: Path,
    label: str,
    per_round: Callable[[int], list[str]] = lambda number: [],
) -> list[Pair]:
    """`count` paired trials, each in a fresh process; round k is also told `per_round(k)` (a seed of
    its own, where the spread over seeds is what is measured)."""
    pairs = []
    for number in range(count):
        pair = paired_trial(kind, config, overrides + per_round(number), run_dir / f"{label}-{number}")
        pairs.append(pair)
        print(
            f"  round {number + 1}/{count} {label}: engine {pair.engine.seconds_per_step * 1e3:.2f} ms/step, "
            f"baseline {pair.baseline.seconds_per_step * 1e3:.2f} ms/step, ratio {pair.ratio:.3f}",
            flush=True,
        )
    return pairs


def median(values: list[float]) -> float:
    return statistics.median(values)
