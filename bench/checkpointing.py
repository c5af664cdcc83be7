"""Benchmark 9: what checkpoints cost the training, written in the step (synchronous) or in the
background (`trainer.async_save`), and how soon a preempted job is gone.

Cases under the deepspeed launcher, ZeRO-2: a synthetic-token GPT of 29M parameters on 2 ranks and
on 1 rank, and the shakespeare config (0.8M) on 2 ranks. The GPT's checkpoint (464 MB: the fp32
weights, master and moments) takes longer to write than a step takes to train. On the 2-core machine
2 ranks keep both cores busy, so the writer can only fill their gaps; 1 rank leaves a core free for
it, as the host's cores are beside a GPU that trains. Each case runs without saves, with a save every
`SAVE_EVERY` steps, and with the same saves in the background, one after the other in each round.
The time lost per save is the timed windows' total (metrics.jsonl: every window after the first,
whose start-up is not timed) less the run's without saves, over the saves that fall in them; it is
reported as a fraction of one step.

Then each 2-rank case is sent SIGTERM, to every process of the job as a scheduler sends it, once 3
windows are logged; the time from the signal to the exit of the last rank is set against one step
(the median window's) plus the save the signal caused, as rank 0's log reports it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, median, read_records, run_logged
from engine.observability import metrics
from engine.parallel.process_group import free_port

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
class Case:
    name: str
    config: Path
    overrides: tuple[str, ...]
    processes: int
    signalled: bool  # also measured from SIGTERM to exit


SYNTHETIC_GPT = (
    "data.type=synthetic",
    "data.seq_len=128",
    "model.vocab_size=8192",
    "model.n_layer=8",
    "model.n_head=8",
    "model.n_embd=512",
    "model.n_positions=128",
    "train_micro_batch_size_per_gpu=2",
    "train_batch_size=auto",
)
CASES = (
    Case("synthetic GPT 29M, 2 ranks", ROOT / "configs" / "tiny_gpt.json", SYNTHETIC_GPT, 2, True),
    Case("synthetic GPT 29M, 1 rank (a core free)", ROOT / "configs" / "tiny_gpt.json", SYNTHETIC_GPT, 1, False),
    Case(
        "shakespeare, 2 ranks",
        ROOT / "configs" / "shakespeare_char.json",
        ("scheduler.params.warmup_num_steps=2",),
        2,
        True,
    ),
)


def timed_seconds(records: list[dict]) -> float:
    """The training time of every logged window after the first (each record's window average
    times its steps): a save is in the window after the step it saves."""
    return sum(record["step_time_s"] * LOG_INTERVAL for record in records if record["step"] > LOG_INTERVAL)


def saves_timed() -> int:
    """Saves inside the timed windows: every SAVE_EVERY steps from the first window's end, the one at
    the last step excepted (it comes after the last window)."""
    return len(range(SAVE_EVERY, STEPS, SAVE_EVERY)) - len(range(SAVE_EVERY, LOG_INTERVAL, SAVE_EVERY))


def launcher(case: Case) -> list[str]:
    """The deepspeed launcher starting the engine on `case`, before its `--set` arguments."""
    ports = ["--num_gpus", str(case.processes), "--master_port", str(free_port())]
    return ["deepspeed", *ports, "engine/main.py", "--deepspeed_config", str(case.config)]


def training_seconds(case: Case, mode: str, run_dir: Path) -> float:
    run_logged(launcher(case), [*COMMON, *case.overrides, f"trainer.max_steps={STEPS}", *MODES[mode]], run_dir)
    return timed_seconds(read_records(run_dir))


def signal_to_exit(case: Case, mode: str, run_dir: Path) -> tuple[float, float, float]:
    """SIGTERM to every process of a long run once 3 windows are logged: seconds from the signal to
    the exit of its last rank, the median step and the save the signal caused."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    background = ["trainer.async_save=true"] if mode == "async" else []
    overrides = ["trainer.max_steps=100000", "trainer.save_interval=0", *background]
    sets = [*COMMON, *case.overrides, *overrides, f"trainer.output_dir={run_dir}"]
    command = launcher(case) + [arg for value in sets for arg in ("--set", value)]
    log = run_dir / "trial.log"
    with log.open("w") as out:
        job = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while len(_records(run_dir)) < 3 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if job.poll() is not None or time.monotonic() >= deadline:
            os.killpg(job.pid, signal.SIGKILL)
            raise RuntimeError(f"{case.name} {mode}: no 3 windows logged; log {log}")
        # The launcher's runner dies of the signal at once; the job has ended when its ranks have.
        ranks = [process for process in psutil.process_iter(["cmdline"]) if _is_rank(process, job.pid)]
        signalled = time.perf_counter()
        os.killpg(job.pid, signal.SIGTERM)
        while any(_running(rank) for rank in ranks) and time.perf_counter() - signalled < 600:
            time.sleep(0.01)
        exit_s = time.perf_counter() - signalled
        job.wait(timeout=60)
        if exit_s >= 600:
            os.killpg(job.pid, signal.SIGKILL)
            raise RuntimeError(f"{case.name} {mode}: ranks alive 600 s after SIGTERM; log {log}")
    rank_log = (run_dir / "logs" / "rank0.log").read_text()
    saves = [float(seconds) for _, seconds in _PUBLISHED.findall(rank_log)]
    if not saves or "stopped (exit code 75)" not in rank_log:
        raise RuntimeError(f"{case.name} {mode}: no save on the signal in {run_dir / 'logs' / 'rank0.log'}")
    return exit_s, median([record["step_time_s"] for record in _records(run_dir)]), saves[-1]


def _running(process: psutil.Process) -> bool:
    """Still running: an exited rank its launcher has not reaped yet (the deepspeed launcher polls
    once a second) is a zombie, done."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_rank(process: psutil.Process, session: int) -> bool:
    """A rank of the job in `session` (or its supervisor): launched with --local_rank."""
    try:
        in_session = os.getsid(process.pid) == session
    except OSError:
        return False
    return in_session and any(arg.startswith("--local_rank=") for arg in process.info["cmdline"] or [])


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return metrics.read_records(path) if path.is_file() else []


def lost_per_save(case: Case, index: int, count: int) -> tuple[float, dict[str, float]]:
    """`count` rounds of each mode on `case`, printed: the seconds of a step and the seconds lost per
    save, synchronous and in the background, each the median over rounds."""
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for number in range(count):
        for mode in MODES:
            run_dir = RUNS / "checkpointing" / f"case-{index}-{mode}-{number}"
            seconds[mode].append(training_seconds(case, mode, run_dir))
    step_s = median(seconds["none"]) / (STEPS - LOG_INTERVAL)
    lost = {
        mode: median([run - base for run, base in zip(seconds[mode], seconds["none"], strict=True)]) / saves_timed()
        for mode in ("sync", "async")
    }
    print(
        f"  {case.name}: step {step_s * 1e3:.1f} ms; lost per save: synchronous {lost['sync'] * 1e3:.1f} ms, "
        f"asynchronous {lost['async'] * 1e3:.1f} ms",
        flush=True,
    )
    return step_s, lost


def exit_row(case: Case, index: int, mode: str) -> Row:
    """SIGTERM to `case` saving in `mode`, printed: its exit against a step plus the signal's save."""
    exit_s, step, save = signal_to_exit(case, mode, RUNS / "checkpointing" / f"case-{index}-{mode}-signal")
    print(
        f"  {case.name}, {mode}: SIGTERM to exit {exit_s:.2f} s; a step {step:.2f} s, its save {save:.2f} s", flush=True
    )
    return compare(
        f"{case.name}, {mode} saves: seconds from SIGTERM to the job's exit, against a step plus its save",
        step + save,
        exit_s,
        Goal("ratio", "<=", 1.0),
    )


def run(settings: Settings) -> Result:
    rows, exit_rows, failures = [], [], {}
    series: dict[str, tuple[list[float], list[float]]] = {"synchronous": ([], []), "asynchronous": ([], [])}
    count = min(settings.rounds, MAX_ROUNDS)
    for index, case in enumerate(CASES):
        try:
            step_s, lost = lost_per_save(case, index, count)
            for label, mode in (("synchronous", "sync"), ("asynchronous", "async")):
                series[label][0].append(index)
                series[label][1].append(lost[mode] / step_s)
            rows.append(
                compare(
                    f"{case.name}: steps of training lost per save, asynchronous against synchronous",
                    lost["sync"] / step_s,
                    lost["async"] / step_s,
                    Goal("ratio", "<=", 0.2),
                    ratio=max(lost["async"], 0.0) / lost["sync"],
                )
            )
            for mode in ("sync", "async") if case.signalled else ():
                exit_rows.append(exit_row(case, index, mode))
        except RuntimeError as error:
            failures[case.name] = str(error)
    return Result(
        name="checkpointing",
        title="Checkpoints: training lost per save, synchronous and in the background; SIGTERM to exit",
        baseline="synchronous save (steps lost per save); a step plus the signal's save (SIGTERM rows)",
        method=method(count),
        rows=rows + exit_rows,
        panels=[
            Panel(
                title="checkpointing: steps of training lost per save",
                xlabel="case (0: GPT 29M 2 ranks, 1: GPT 29M 1 rank, 2: shakespeare 2 ranks)",
                ylabel="steps lost per save",
                series=series,
            )
        ],
        machine=machine_facts(1),
        failures=failures,
    )


def method(count: int) -> str:
    """How the figures were made, for `count` rounds."""
    cases = "; ".join(f"{case.name}: {case.config.relative_to(ROOT)} {' '.join(case.overrides)}" for case in CASES)
    return (
        f"The deepspeed launcher, ZeRO-2, {', '.join(COMMON)}. Per case and round ({count} rounds): {STEPS} "
        f"steps without saves, with a save every {SAVE_EVERY} steps, and with trainer.async_save; the loss per "
        "save is the timed windows' total (every window after the first) less the run's without saves, over "
        f"the {saves_timed()} saves in them, the median over rounds, in steps (the baseline and engine columns "
        "of the first rows; their ratio is asynchronous over synchronous, a negative loss counted as 0). Cases: "
        + cases
        + ". The SIGTERM rows: a run without scheduled saves, SIGTERM to every process of the job (its own "
        "session) after 3 logged windows; seconds to the last rank's exit (an exited rank its launcher has "
        "not reaped counts as gone; the deepspeed launcher itself exits about 2.4 s later, polling once a "
        "second and unloading torch) against the median window's step plus the save the signal caused "
        "(rank 0's log), the goal a ratio of at most 1. On 2 cores, 2 ranks "
        "leave the background writer no idle core: it fills the ranks' waits, and its copying competes with "
        "theirs for memory bandwidth."
    )
