"""Benchmark 7: the tokenized-corpus data path (issue 28) against corpus size: how fast a corpus is
prepared, how long a launch takes to reach step 1, and how much memory each rank holds.

Corpora of SIZES_MB megabytes (10^6 bytes) are made at run time from tinyshakespeare repeated to
size, in a temporary folder removed at the end: a 1 GB text file is never committed. Three parts:

- Preparation: `prepare_text` into an empty cache, timed in this process beside a bare baseline,
  each the best of PREPARE_REPEATS, the two alternating so that drift in a shared machine's load
  reaches both. Byte and char preparation are compared with reading the file into a uint8 array
  (`np.frombuffer(path.read_bytes(), np.uint8)`): a byte tokenizer's whole work, and the floor of
  any preparation, since every token file is made from one read of the text; a char tokenizer's
  bare cost (a table lookup per byte of ASCII text) is of the same order, so the same floor serves
  it. BPE (a byte-level tokenizer of BPE_VOCAB ids trained on tinyshakespeare at run time, saved
  as Hugging Face files) is compared with the tokenizer's own batched call,
  `backend_tokenizer.encode_batch_fast`, on the very batches of pieces the engine cuts
  (data/tokens/encode.py), read and cut before the clock starts: the tokenizer alone. BPE runs
  only up to BPE_MAX_MB: at a few MB/s on 2 cores, 1 GB would take several minutes per repeat.
- Launches: `./launch.sh --nproc N configs/tiny_gpt.json` on the byte tokenizer, as a user types
  it, for N in RANKS. A first launch finds an empty cache (its `validate` tokenizes the corpus
  before any rank starts), a cached launch the same cache again. Each is timed from the start of
  launch.sh to the time stamp of its first metrics record (written as step 1 ends); the figure is
  the median over `--rounds` rounds, each with a fresh cache.
- Memory: the peak RSS (VmHWM) of every rank process, read from /proc every POLL_S seconds while
  the launch runs; the high-water mark only grows, so only growth in a rank's last POLL_S is missed.
  (The metrics records' `ranks[].rss_bytes`, engine/observability/memory.py, is the RSS at a logged step, not the
  peak.) It counts the pages of the memory-mapped token file that a rank has touched, so a rank that
  read the whole corpus would show it.
  A rank's figure is its largest over the first and cached launches of every round.

Sizes: `BENCH_DATA_MB=1,3 python -m bench data` measures other sizes (the first is the baseline of
the launch and memory rows): bench/settings.py's flags are shared by every benchmark, and sizes are
this one's alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, read_records, run_overrides
from data.tokens.corpus import open_corpus
from data.tokens.encode import _batches  # the engine's own batches of pieces: the baseline must encode the same
from data.tokens.prepare import prepare_text

SOURCE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
CONFIG = ROOT / "configs" / "tiny_gpt.json"
RUN_DIR = RUNS / "data"  # each launch's log, metrics and checkpoints, kept for a look after the run
SIZES_MB = (10.0, 100.0, 1000.0)
SIZES_ENV = "BENCH_DATA_MB"
BPE_MAX_MB = 100.0
BPE_VOCAB = 2000
RANKS = (1, 2)
STEPS = 3
PREPARE_REPEATS = 3
POLL_S = 0.1
CACHE_TIMEOUT_S = 3600.0
MIB = 1 << 20

# Goals of issue 28.
RSS_GOAL = Goal("ratio", "<=", 1.10)  # a rank's peak RSS on a corpus, against the smallest corpus
CACHED_LAUNCH_GOAL = Goal("ratio", "<=", 1.2)  # a cached launch to step 1, against the smallest corpus
PREPARE_GOAL = Goal("engine", ">=", 100.0)  # byte and char preparation, MB/s
BPE_GOAL = Goal("ratio", "<=", 1.2)  # BPE preparation time against the tokenizer's batched call
TRAINS_GOAL = Goal("ratio", ">=", 1.0)  # steps trained on the largest corpus and the most ranks, of STEPS


@dataclass(frozen=True)
class Preparation:
    """One tokenizer on one corpus: the engine's and the baseline's best seconds, and the tokens
    (checked equal on both sides)."""

    tokenizer: str
    size_mb: float
    engine_s: float
    baseline_s: float
    tokens: int


@dataclass(frozen=True)
class Launch:
    """One launch: seconds from launch.sh's start to step 1, each rank's peak RSS, the last step."""

    seconds_to_step_1: float
    peak_rss: dict[int, int]  # rank -> bytes
    steps: int


def sizes_mb() -> tuple[float, ...]:
    """SIZES_MB, or the sizes $BENCH_DATA_MB lists; at least two, since the launch and memory rows
    compare every size with the smallest."""
    text = os.environ.get(SIZES_ENV)
    if not text:
        return SIZES_MB
    try:
        sizes = tuple(sorted({float(part) for part in text.split(",")}))
    except ValueError:
        raise RuntimeError(f"{SIZES_ENV}={text!r}: expected corpus sizes in MB separated by commas, e.g. 1,3") from None
    if len(sizes) < 2 or sizes[0] <= 0:
        raise RuntimeError(f"{SIZES_ENV}={text!r}: give at least two different positive sizes in MB")
    return sizes


def run(settings: Settings) -> Result:
    return measure(settings, sizes_mb())


def measure(
    settings: Settings, sizes: tuple[float, ...], ranks: tuple[int, ...] = RANKS, *, warm_up: bool = True
) -> Result:
    """Every part on corpora of `sizes` MB (ascending, at least two), launched on each count of `ranks`.
    `warm_up=False` drops the warm-up launch (see `time_launches`) where earlier launches have built
    DeepSpeed's op: the test suite's, for time."""
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        scratch = Path(scratch)
        corpora = {size: make_corpus(size, scratch / f"corpus-{size:g}MB.txt") for size in sizes}
        tokenizers = {"byte": "byte", "char": "char", "BPE": str(train_bpe(scratch / "bpe"))}
        preparations = [
            time_preparation(name, spec, corpus, size, scratch / "prepare-cache")
            for size, corpus in corpora.items()
            for name, spec in tokenizers.items()
            if name != "BPE" or size <= BPE_MAX_MB
        ]
        launches, failures = time_launches(
            corpora, ranks, settings.threads, settings.rounds, scratch / "cache", warm_up=warm_up
        )
    return data_result(preparations, launches, failures, sizes, ranks, settings.rounds, machine_facts(settings.threads))


def make_corpus(size_mb: float, path: Path) -> Path:
    """tinyshakespeare repeated to `size_mb` MB, written piece by piece (a 1 GB bytes object would
    itself be 1 GB of this process's memory). The text is ASCII, so any cut is valid UTF-8."""
    source, remaining = SOURCE.read_bytes(), int(size_mb * 1e6)
    with path.open("wb") as out:
        while remaining:
            remaining -= out.write(source[:remaining])
    return path


def train_bpe(directory: Path) -> Path:
    """A byte-level BPE tokenizer (GPT-2's pre-tokenizer) trained on tinyshakespeare, saved as Hugging
    Face files: what `data.tokenizer` names for a BPE corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([SOURCE.read_text(encoding="utf-8")], trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(directory)
    return directory


# Preparation


def time_preparation(name: str, spec: str, corpus: Path, size_mb: float, cache: Path) -> Preparation:
    """The best of PREPARE_REPEATS preparations of `corpus` into an empty `cache`, each after one
    run of the baseline."""
    baseline = (lambda: bare_read(corpus)) if spec in ("byte", "char") else tokenizer_alone(spec, corpus)
    engine_s = baseline_s = float("inf")
    for _ in range(PREPARE_REPEATS):
        seconds, baseline_tokens = _timed(baseline)
        baseline_s = min(baseline_s, seconds)
        shutil.rmtree(cache, ignore_errors=True)
        seconds, engine_tokens = _timed(lambda: prepare(corpus, spec, cache))
        engine_s = min(engine_s, seconds)
    shutil.rmtree(cache)
    if engine_tokens != baseline_tokens:
        raise RuntimeError(
            f"prepare {name}, {_label(size_mb)}: the engine wrote {engine_tokens:,} tokens where its baseline "
            f"counted {baseline_tokens:,}; they are not doing the same work"
        )
    speeds = f"{size_mb / engine_s:,.1f} MB/s, baseline {size_mb / baseline_s:,.1f} MB/s"
    print(f"  prepare {name}, {_label(size_mb)}: {speeds}", flush=True)
    return Preparation(name, size_mb, engine_s, baseline_s, engine_tokens)


def prepare(corpus: Path, spec: str, cache: Path) -> int:
    """What `python -m engine prepare-data` does for a .txt corpus; returns the tokens written."""
    prepared, _ = prepare_text(
        [corpus], tokenizer=spec, text_field="text", cache_dir=cache, timeout_s=CACHE_TIMEOUT_S, announce=_quiet
    )
    return prepared.meta["splits"]["train"]["tokens"]


def bare_read(corpus: Path) -> int:
    return len(np.frombuffer(corpus.read_bytes(), dtype=np.uint8))


def tokenizer_alone(tokenizer_dir: str, corpus: Path) -> Callable[[], int]:
    """The tokenizer's own batched call on the engine's batches of pieces, read and cut here ahead of
    time so that only the encoding is timed; it counts the tokens without copying them out of Rust."""
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True).backend_tokenizer
    documents = open_corpus([corpus], "text", corpus.parent / "scratch").splits["train"]()
    batches = [batch.pieces for batch in _batches(documents, cut=True)]

    def encode() -> int:
        return sum(
            len(encoding)
            for pieces in batches
            for encoding in backend.encode_batch_fast(pieces, add_special_tokens=False)
        )

    return encode


def _timed(work: Callable[[], int]) -> tuple[float, int]:
    started = time.perf_counter()
    value = work()
    return time.perf_counter() - started, value


def _quiet(message: str) -> None:
    """prepare_text's announcements: the benchmark prints its own line per measurement."""


# Launches


def time_launches(
    corpora: dict[float, Path], ranks: tuple[int, ...], threads: int, rounds: int, cache: Path, *, warm_up: bool
) -> tuple[dict[tuple[float, int, str], Launch], dict[str, str]]:
    """A first and a cached launch per corpus and rank count in each of `rounds` rounds, summed up
    (`_summary`) under (size, ranks, "first" or "cached"), and the error of each launch that failed.
    Rounds go over every corpus in turn, so a shared machine's changing load reaches all sizes alike.
    With `warm_up`, an unmeasured launch goes first, so that DeepSpeed's one-time build of its CPU
    communication op (a minute or two, on a machine that never launched it) is not charged to the first
    figure."""
    failures: dict[str, str] = {}
    if warm_up:
        smallest = min(corpora)
        shutil.rmtree(cache, ignore_errors=True)
        sets = launch_sets(corpora[smallest], cache, max(1, threads // max(ranks)))
        _attempt(max(ranks), sets, f"{_label(smallest)}, warm-up", failures)
    runs: dict[tuple[float, int, str], list[Launch | None]] = {}
    for number in range(1, rounds + 1):
        for size, corpus in corpora.items():
            for count in ranks:
                shutil.rmtree(cache, ignore_errors=True)  # an empty cache for the first launch
                sets = launch_sets(corpus, cache, max(1, threads // count))
                for kind in ("first", "cached"):
                    label = f"{_label(size)}, {kind} launch, round {number}"
                    runs.setdefault((size, count, kind), []).append(_attempt(count, sets, label, failures))
    shutil.rmtree(cache, ignore_errors=True)
    summaries = {key: _summary(launches) for key, launches in runs.items()}
    return {key: summary for key, summary in summaries.items() if summary is not None}, failures


def _attempt(ranks: int, sets: list[str], label: str, failures: dict[str, str]) -> Launch | None:
    """One launch, printed; None, with its error in `failures`, if it failed."""
    label = f"{_ranks(ranks)}, {label}"
    try:
        measured = launch(ranks, sets, RUN_DIR / label.replace(", ", "-").replace(" ", "-"))
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


def launch_sets(corpus: Path, cache: Path, threads: int) -> list[str]:
    """The overrides of every launch: the corpus on the byte tokenizer, its own cache, a short run."""
    return [
        f"data.path={corpus}",
        "data.tokenizer=byte",
        f"data.cache_dir={cache}",
        *run_overrides(STEPS, 1, eval_batches=1, threads=threads),
    ]


def watched_launch(command: list[str], run_dir: Path, ranks: int) -> dict[int, int]:
    """Run `command`, a launch of `ranks` ranks, its output in `run_dir`/trial.log, and return each
    rank's peak resident memory; raise with the log's tail where it fails or a rank went unread."""
    log = run_dir / "trial.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        peaks = watch_ranks(process)
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {process.returncode}; log {log}:\n{tail}")
    if sorted(peaks) != list(range(ranks)):
        raise RuntimeError(f"{run_dir}: read the peak RSS of ranks {sorted(peaks)} of {ranks} (is /proc there?)")
    return peaks


def launch(ranks: int, sets: list[str], run_dir: Path) -> Launch:
    """./launch.sh on `ranks` CPU processes (or GPUs), watched until it exits."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh directory: no earlier metrics or checkpoints
    run_dir.mkdir(parents=True)
    command = ["./launch.sh", "--nproc", str(ranks), str(CONFIG)]
    command += [arg for value in [*sets, f"trainer.output_dir={run_dir}"] for arg in ("--set", value)]
    started = time.time()  # wall-clock, as the metrics records' time stamps
    peaks = watched_launch(command, run_dir, ranks)
    records = read_records(run_dir)
    return Launch(records[0]["time"] - started, peaks, records[-1]["step"])


def watch_ranks(process: subprocess.Popen) -> dict[int, int]:
    """Each rank's peak RSS while `process` runs, in bytes: the largest VmHWM among the processes
    that run engine/main.py with that RANK (the rank and its small supervisor,
    engine/failures/supervise.py), read every POLL_S seconds."""
    launcher, known, peaks = psutil.Process(process.pid), {}, {}
    while process.poll() is None:
        try:
            children = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            if child.pid not in known:
                # Not cached when None: a rank is seen between fork and exec with its parent's identity.
                rank = _rank_of(child)
                if rank is None:
                    continue
                known[child.pid] = rank
            high_water = _high_water(child.pid)
            if high_water is not None:
                peaks[known[child.pid]] = max(peaks.get(known[child.pid], 0), high_water)
        time.sleep(POLL_S)
    return peaks


def _rank_of(process: psutil.Process) -> int | None:
    try:
        if not any(arg.endswith("engine/main.py") for arg in process.cmdline()):
            return None
        rank = process.environ().get("RANK")
    except psutil.Error:
        return None
    return None if rank is None else int(rank)


def _high_water(pid: int) -> int | None:
    """The process's peak resident set (VmHWM), None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# The result


def data_result(
    preparations: list[Preparation],
    launches: dict[tuple[float, int, str], Launch],
    failures: dict[str, str],
    sizes: tuple[float, ...],
    ranks: tuple[int, ...],
    rounds: int,
    machine: dict[str, Any],
) -> Result:
    """Rows, largest corpus first: each rank's peak RSS and the launch times against the smallest
    corpus, whether the largest trains on the most ranks, then preparation against its baseline."""
    smallest, larger = sizes[0], sorted(sizes[1:], reverse=True)
    rows: list[Row] = []
    for count in ranks:
        for size in larger:
            for rank in range(count):
                base, peak = _peak(launches, smallest, count, rank), _peak(launches, size, count, rank)
                if base is not None and peak is not None:
                    quantity = f"{_ranks(count)}, {_label(size)} vs {_label(smallest)}: rank {rank} peak RSS, MiB"
                    rows.append(compare(quantity, base / MIB, peak / MIB, RSS_GOAL))
    for kind, goal in (("cached", CACHED_LAUNCH_GOAL), ("first", None)):
        for count in ranks:
            for size in larger:
                base, here = launches.get((smallest, count, kind)), launches.get((size, count, kind))
                if base is not None and here is not None:
                    quantity = f"{_ranks(count)}, {_label(size)} vs {_label(smallest)}: {kind} launch to step 1, s"
                    rows.append(compare(quantity, base.seconds_to_step_1, here.seconds_to_step_1, goal))
    largest, most = sizes[-1], max(ranks)
    trained = [launches.get((largest, most, kind)) for kind in ("first", "cached")]
    steps = min(0 if run is None else run.steps for run in trained)
    rows.append(compare(f"{_ranks(most)}, {_label(largest)}: steps trained of {STEPS}", STEPS, steps, TRAINS_GOAL))
    for preparation in sorted(preparations, key=lambda p: -p.size_mb):
        rows += _preparation_rows(preparation)
    labels = ", ".join(map(_label, sizes))
    return Result(
        name="data",
        title="Tokenized corpora: preparation speed, launch time and memory per rank against corpus size",
        baseline="baseline",
        method=(
            f"Corpora of {labels} (tinyshakespeare repeated, made at run time). Preparation: `prepare_text` into an "
            f"empty cache, best of {PREPARE_REPEATS}, alternating with its baseline in one process: for byte and "
            "char, reading the file into a uint8 array (the floor of any preparation, and a byte tokenizer's "
            f"whole work); for BPE (byte-level, {BPE_VOCAB} ids, trained on tinyshakespeare at run time; up to "
            f"{_label(BPE_MAX_MB)} only, for time), the tokenizer's own `encode_batch_fast` on the engine's "
            "batches of pieces, cut before the clock starts. Launches: `./launch.sh --nproc N "
            f"{CONFIG.relative_to(ROOT)}` on the byte tokenizer, {STEPS} steps, timed from launch.sh's start to "
            "the time stamp of the first metrics record (step 1), the median of "
            f"{rounds} round{'s' if rounds > 1 else ''}; a first launch finds an empty cache, which its `validate` "
            "fills before any rank starts, a cached launch finds it filled; an unmeasured warm-up launch goes "
            f"first. Peak RSS: each rank process's VmHWM, read from /proc every {POLL_S * 1000:.0f} ms, its "
            "largest over the first and cached launches of every round. Launch and memory rows compare each "
            f"corpus with the {_label(smallest)} one on the same ranks. " + BEFORE
        ),
        rows=rows,
        panels=[
            Panel(
                title="data: peak RSS per rank",
                xlabel="corpus MB",
                ylabel="MiB",
                series={
                    f"{_ranks(count)}: rank {rank}": _points(
                        sizes, [_peak(launches, size, count, rank) for size in sizes], MIB
                    )
                    for count in ranks
                    for rank in range(count)
                },
            ),
            Panel(
                title="data: launch to step 1",
                xlabel="corpus MB",
                ylabel="seconds",
                series={
                    f"{_ranks(count)}, {kind}": _points(
                        sizes, [_seconds(launches.get((size, count, kind))) for size in sizes], 1
                    )
                    for count in ranks
                    for kind in ("first", "cached")
                },
            ),
        ],
        machine=machine,
        failures=failures,
    )


def _preparation_rows(preparation: Preparation) -> list[Row]:
    name, size, tokens = preparation.tokenizer, preparation.size_mb, preparation.tokens
    engine_s, baseline_s = preparation.engine_s, preparation.baseline_s
    head = f"{name}, {_label(size)}: prepare"
    if name == "BPE":
        versus = "encode_batch_fast alone"
        return [
            compare(f"{head} seconds vs {versus}", baseline_s, engine_s, BPE_GOAL),
            compare(f"{head} MB/s vs {versus}", size / baseline_s, size / engine_s),
            compare(f"{head} tokens/s vs {versus}", tokens / baseline_s, tokens / engine_s),
        ]
    return [
        compare(f"{head} MB/s vs bare read", size / baseline_s, size / engine_s, PREPARE_GOAL),
        compare(f"{head} tokens/s vs bare read", tokens / baseline_s, tokens / engine_s),
    ]


def _peak(launches: dict[tuple[float, int, str], Launch], size: float, ranks: int, rank: int) -> int | None:
    """A rank's peak RSS over the first and the cached launch; None if neither measured it."""
    peaks = [
        launches[size, ranks, kind].peak_rss[rank]
        for kind in ("first", "cached")
        if (size, ranks, kind) in launches and rank in launches[size, ranks, kind].peak_rss
    ]
    return max(peaks) if peaks else None


def _seconds(launch: Launch | None) -> float | None:
    return None if launch is None else launch.seconds_to_step_1


def _points(sizes: tuple[float, ...], values: list[float | None], unit: float) -> tuple[list[float], list[float]]:
    """The (size, value / unit) points where a value was measured."""
    measured = [(size, value) for size, value in zip(sizes, values, strict=True) if value is not None]
    return [size for size, _ in measured], [value / unit for _, value in measured]


BEFORE = (
    "Before the token cache (commit 134f610, the same machine, as issue 28 measured it): every rank read and "
    "tokenized the whole corpus into memory, so a 1 GB byte corpus took 146 s to step 1 at a peak RSS of "
    "17.2 GiB on one rank and did not fit two ranks in 24 GiB; 100 MB on 2 ranks took 48 s at 2.09 GiB per "
    "rank. Char preparation ran at 78 MB/s on 100 MB with numpy over UTF-32 code points, before the "
    "`bytes.translate` encoder."
)


def _label(size_mb: float) -> str:
    return f"{size_mb / 1000:g} GB" if size_mb >= 1000 else f"{size_mb:g} MB"


def _ranks(count: int) -> str:
    return f"{count} rank" + ("s" if count > 1 else "")
