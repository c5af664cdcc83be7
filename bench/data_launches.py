"""The data benchmark's launch part: `./launch.sh` as a user types it, timed from its start to step 1,
each rank's peak memory watched (bench/rank_memory.py), in rounds of a first launch on an empty cache
and a cached launch on the same cache again."""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.data_labels import ranks_label, size_label
from bench.rank_memory import MIB, watched_launch
from bench.trials import read_records

Overrides = Callable[[Path, int], list[str]]
"""The `--set` values of a launch on a corpus and a rank count."""


@dataclass(frozen=True)
class Launch:
    """One launch: seconds from launch.sh's start to step 1, each rank's peak RSS, the last step."""

    seconds_to_step_1: float
    peak_rss: dict[int, int]  # rank -> bytes
    steps: int


def time_launches(
    config: Path,
    corpora: dict[float, Path],
    ranks: tuple[int, ...],
    rounds: int,
    *,
    overrides: Overrides,
    cache: Path,
    run_root: Path,
    warm_up: bool,
) -> tuple[dict[tuple[float, int, str], Launch], dict[str, str]]:
    """A first and a cached launch of `config` per corpus and rank count in each of `rounds` rounds,
    summed up (`_summary`) under (size, ranks, "first" or "cached"), and the error of each launch that
    failed. `cache` is the one the overrides name: emptied before each first launch. Rounds go over
    every corpus in turn, so a shared machine's changing load reaches all sizes alike. With `warm_up`,
    an unmeasured launch goes first, so that DeepSpeed's one-time build of its CPU communication op
    (a minute or two, on a machine that never launched it) is not charged to the first figure."""
    failures: dict[str, str] = {}
    if warm_up:
        smallest = min(corpora)
        shutil.rmtree(cache, ignore_errors=True)
        sets = overrides(corpora[smallest], max(ranks))
        _attempt(config, max(ranks), sets, f"{size_label(smallest)}, warm-up", run_root, failures)
    runs: dict[tuple[float, int, str], list[Launch | None]] = {}
    for number in range(1, rounds + 1):
        for size, corpus in corpora.items():
            for count in ranks:
                shutil.rmtree(cache, ignore_errors=True)  # an empty cache for the first launch
                sets = overrides(corpus, count)
                for kind in ("first", "cached"):
                    label = f"{size_label(size)}, {kind} launch, round {number}"
                    measured = _attempt(config, count, sets, label, run_root, failures)
                    runs.setdefault((size, count, kind), []).append(measured)
    shutil.rmtree(cache, ignore_errors=True)
    summaries = {key: _summary(launches) for key, launches in runs.items()}
    return {key: summary for key, summary in summaries.items() if summary is not None}, failures


def _attempt(
    config: Path, ranks: int, sets: list[str], label: str, run_root: Path, failures: dict[str, str]
) -> Launch | None:
    """One launch, its files in a folder of `run_root` named by `label`, printed; None, with its error
    in `failures`, if it failed."""
    label = f"{ranks_label(ranks)}, {label}"
    try:
        measured = launch(config, ranks, sets, run_root / label.replace(", ", "-").replace(" ", "-"))
    except RuntimeError as error:
        print(f"  {label}: FAILED", flush=True)
        failures[label] = str(error)
        return None
    peaks = ", ".join(f"rank {rank} {peak / MIB:,.0f} MiB" for rank, peak in sorted(measured.peak_rss.items()))
    print(f"  {label}: step 1 after {measured.seconds_to_step_1:.1f} s; peak RSS {peaks}", flush=True)
    return measured


def _summary(launches: list[Launch | None]) -> Launch | None:
    """The rounds of one launch as one: the median time to step 1, each rank's largest peak RSS, and
    the fewest steps trained (0 if any round failed); None if every round failed."""
    done = [launch for launch in launches if launch is not None]
    if not done:
        return None
    ranks = {rank for launch in done for rank in launch.peak_rss}
    return Launch(
        seconds_to_step_1=statistics.median(launch.seconds_to_step_1 for launch in done),
        peak_rss={rank: max(launch.peak_rss.get(rank, 0) for launch in done) for rank in ranks},
        steps=min(0 if launch is None else launch.steps for launch in launches),
    )


def launch(config: Path, ranks: int, sets: list[str], run_dir: Path) -> Launch:
    """./launch.sh on `ranks` CPU processes (or GPUs), watched until it exits."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh directory: no earlier metrics or checkpoints
    run_dir.mkdir(parents=True)
    command = ["./launch.sh", "--nproc", str(ranks), str(config)]
    command += [arg for value in [*sets, f"trainer.output_dir={run_dir}"] for arg in ("--set", value)]
    started = time.time()  # wall-clock, as the metrics records' time stamps
    peaks = watched_launch(command, run_dir, ranks)
    records = read_records(run_dir)
    return Launch(records[0]["time"] - started, peaks, records[-1]["step"])
