"""Benchmark 9: what checkpoints cost the training, written in the step (synchronous) or in the
background (`trainer.async_save`), and how soon a preempted job is gone.

Two models on 2 ranks under the deepspeed launcher, ZeRO-2: a synthetic-token GPT of 29M
parameters and the shakespeare config (0.8M). The GPT's checkpoint (a rank's ZeRO-2 partition of the
fp32 master and moments, rank 0 also the weights) takes longer to write than a step takes to train.
Each is run without saves, with a save every `SAVE_EVERY` steps, and with the same saves in the
background, one after the other in each round. The time lost per save is the difference of the timed
windows' total time (metrics.jsonl: every window after the first, whose start-up is not timed) from
the run without saves, over the saves that fall in them; it is reported as a fraction of one step.

Then a run of each model is sent SIGTERM through the launcher once it has logged 3 windows, and the
time from the signal to the launcher's exit is set against one step (the median window's) plus the
save the signal caused, as rank 0's log reports it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, median, read_records, run_logged
from engine.observability import metrics
from engine.parallel.process_group import free_port

PROCESSES = 2
STEPS, LOG_INTERVAL, SAVE_EVERY = 24, 4, 4
MAX_ROUNDS = 3
COMMON = [
    "zero_optimization.stage=2",
    "trainer.eval_interval=0",
    "trainer.eval_batches=1",
    f"trainer.log_interval={LOG_INTERVAL}",
    "trainer.threads_per_rank=1",
    "trainer.export=false",
    "trainer.plots=false",
    "trainer.progress_bar=false",
    "trainer.sample_tokens=0",
]
MODES = {
    "none": ["trainer.save_interval=0"],
    "sync": [f"trainer.save_interval={SAVE_EVERY}"],
    "async": [f"trainer.save_interval={SAVE_EVERY}", "trainer.async_save=true"],
}
_PUBLISHED = re.compile(r"checkpoint step(\d{8}) published ([0-9.]+) s")


@dataclass(frozen=True)
class Model:
    name: str
    config: Path
    overrides: tuple[str, ...]


MODELS = (
    Model(
        "synthetic GPT 29M",
        ROOT / "configs" / "tiny_gpt.json",
        (
            "data.type=synthetic",
            "data.seq_len=128",
            "model.vocab_size=8192",
            "model.n_layer=8",
            "model.n_head=8",
            "model.n_embd=512",
            "model.n_positions=128",
            "train_micro_batch_size_per_gpu=2",
            "train_batch_size=auto",
        ),
    ),
    Model("shakespeare", ROOT / "configs" / "shakespeare_char.json", ("scheduler.params.warmup_num_steps=2",)),
)


def timed_seconds(records: list[dict]) -> float:
    """The training time of every logged window after the first (each record's window average
    times its steps): a save is in the window after the step it saves."""
    return sum(record["step_time_s"] * LOG_INTERVAL for record in records if record["step"] > LOG_INTERVAL)


def saves_timed() -> int:
    """Saves inside the timed windows: every SAVE_EVERY steps from the first window's end, the one at
    the last step excepted (it comes after the last window)."""
    return len(range(SAVE_EVERY, STEPS, SAVE_EVERY)) - len(range(SAVE_EVERY, LOG_INTERVAL, SAVE_EVERY))


def training_seconds(model: Model, mode: str, run_dir: Path) -> float:
    launcher = ["deepspeed", "--num_gpus", str(PROCESSES), "--master_port", str(free_port())]
    overrides = [*COMMON, *model.overrides, f"trainer.max_steps={STEPS}", *MODES[mode]]
    run_logged([*launcher, "engine/main.py", "--deepspeed_config", str(model.config)], overrides, run_dir)
    return timed_seconds(read_records(run_dir))


def signal_to_exit(model: Model, mode: str, run_dir: Path) -> tuple[float, float, float]:
    """SIGTERM to the launcher of a long run once 3 windows are logged: seconds from the signal to
    its exit, the median step and the save the signal caused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("**/*"):
        if stale.is_file():
            stale.unlink()
    background = ["trainer.async_save=true"] if mode == "async" else []
    overrides = [*COMMON, *model.overrides, "trainer.max_steps=100000", "trainer.save_interval=0", *background]
    command = ["deepspeed", "--num_gpus", str(PROCESSES), "--master_port", str(free_port()), "engine/main.py"]
    command += ["--deepspeed_config", str(model.config)]
    command += [arg for value in [*overrides, f"trainer.output_dir={run_dir}"] for arg in ("--set", value)]
    log = run_dir / "trial.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while len(_records(run_dir)) < 3 and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if launcher.poll() is not None or time.monotonic() >= deadline:
            launcher.kill()
            raise RuntimeError(f"{model.name} {mode}: no 3 windows logged; log {log}")
        signalled = time.perf_counter()
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=600)
        exit_s = time.perf_counter() - signalled
    saves = [float(seconds) for _, seconds in _PUBLISHED.findall((run_dir / "logs" / "rank0.log").read_text())]
    if not saves:
        raise RuntimeError(f"{model.name} {mode}: the signal's save is not in {run_dir / 'logs' / 'rank0.log'}")
    return exit_s, median([record["step_time_s"] for record in _records(run_dir)]), saves[-1]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return metrics.read_records(path) if path.is_file() else []


def run(settings: Settings) -> Result:
    rows, exit_rows, failures = [], [], {}
    series: dict[str, tuple[list[float], list[float]]] = {"synchronous": ([], []), "asynchronous": ([], [])}
    count = min(settings.rounds, MAX_ROUNDS)
    for index, model in enumerate(MODELS):
        try:
            seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
            for number in range(count):
                for mode in MODES:
                    run_dir = RUNS / "checkpointing" / f"model-{index}-{mode}-{number}"
                    seconds[mode].append(training_seconds(model, mode, run_dir))
            timed_steps = STEPS - LOG_INTERVAL
            step_s = median(seconds["none"]) / timed_steps
            lost = {
                mode: median([(run - base) for run, base in zip(seconds[mode], seconds["none"], strict=True)])
                / saves_timed()
                for mode in ("sync", "async")
            }
            print(
                f"  {model.name}: step {step_s * 1e3:.1f} ms; lost per save: synchronous {lost['sync'] * 1e3:.1f} ms, "
                f"asynchronous {lost['async'] * 1e3:.1f} ms",
                flush=True,
            )
            for label, mode in (("synchronous", "sync"), ("asynchronous", "async")):
                series[label][0].append(index)
                series[label][1].append(lost[mode] / step_s)
            rows.append(
                compare(
                    f"{model.name}: training time lost per save, asynchronous against synchronous",
                    lost["sync"] / step_s,
                    lost["async"] / step_s,
                    Goal("ratio", "<=", 0.2),
                    ratio=max(lost["async"], 0.0) / lost["sync"],
                )
            )
            for mode in ("sync", "async"):
                run_dir = RUNS / "checkpointing" / f"model-{index}-{mode}-signal"
                exit_s, step, save = signal_to_exit(model, mode, run_dir)
                print(
                    f"  {model.name} {mode}: SIGTERM to exit {exit_s:.2f} s; a step {step:.2f} s, its save "
                    f"{save:.2f} s",
                    flush=True,
                )
                exit_rows.append(
                    compare(
                        f"{model.name}, {mode} saves: seconds from SIGTERM to the job's exit, against a step plus "
                        "the save",
                        step + save,
                        exit_s,
                        Goal("ratio", "<=", 1.0),
                    )
                )
        except RuntimeError as error:
            failures[model.name] = str(error)
    models = "; ".join(
        f"{model.name}: {model.config.relative_to(ROOT)} {' '.join(model.overrides)}" for model in MODELS
    )
    return Result(
        name="checkpointing",
        title="Checkpoints: training time lost per save, synchronous and in the background; SIGTERM to exit",
        baseline="synchronous save (first rows: its loss, in steps); a step plus the signal's save (SIGTERM rows)",
        method=(
            f"{PROCESSES} ranks under the deepspeed launcher, ZeRO-2, {', '.join(COMMON)}. Per model and round "
            f"({count} rounds): {STEPS} steps without saves, with a save every {SAVE_EVERY} steps, and with "
            "trainer.async_save; the loss per save is the timed windows' total (every window after the first) less "
            f"the run's without saves, over the {saves_timed()} saves in them, the median over rounds, as a "
            "fraction of one step (the baseline and engine columns of the first rows; their ratio is "
            "asynchronous over synchronous, a negative loss counted as 0). Models: "
            + models
            + ". The SIGTERM rows: a run without scheduled saves, signalled through the launcher after 3 logged "
            "windows; seconds to the launcher's exit against the median window's step plus the save the signal "
            "caused (rank 0's log), the goal a ratio of at most 1."
        ),
        rows=rows + exit_rows,
        panels=[
            Panel(
                title="checkpointing: training time lost per save, in steps",
                xlabel="model (0: synthetic GPT 29M, 1: shakespeare)",
                ylabel="steps lost per save",
                series=series,
            )
        ],
        machine=machine_facts(1),
        failures=failures,
    )
