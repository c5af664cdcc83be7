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
  the launch runs (bench/rank_memory.py); the high-water mark only grows, so only growth in a rank's
  last POLL_S is missed. (The metrics records' `ranks[].rss_bytes`, engine/observability/memory.py,
  is the RSS at a logged step, not the peak.) It counts the pages of the memory-mapped token file
  that a rank has touched, so a rank that read the whole corpus would show it.
  A rank's figure is its largest over the first and cached launches of every round.

The parts live beside this module: bench/data_preparation.py, bench/data_launches.py and
bench/rank_memory.py; this one makes the corpora and the BPE tokenizer, runs the parts and writes
the rows.

Sizes: `BENCH_DATA_MB=1,3 python -m bench data` measures other sizes (the first is the baseline of
the launch and memory rows): bench/settings.py's flags are shared by every benchmark, and sizes are
this one's alone.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from bench.data_labels import ranks_label, size_label
from bench.data_launches import Launch, time_launches
from bench.data_preparation import Preparation, time_preparation
from bench.machine import machine_facts
from bench.rank_memory import MIB, POLL_S
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, run_overrides

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

# Goals of issue 28.
RSS_GOAL = Goal("ratio", "<=", 1.10)  # a rank's peak RSS on a corpus, against the smallest corpus
CACHED_LAUNCH_GOAL = Goal("ratio", "<=", 1.2)  # a cached launch to step 1, against the smallest corpus
PREPARE_GOAL = Goal("engine", ">=", 100.0)  # byte and char preparation, MB/s
BPE_GOAL = Goal("ratio", "<=", 1.2)  # BPE preparation time against the tokenizer's batched call
TRAINS_GOAL = Goal("ratio", ">=", 1.0)  # steps trained on the largest corpus and the most ranks, of STEPS

Launches = dict[tuple[float, int, str], Launch]
"""Each launch summed over its rounds, under (corpus size, ranks, "first" or "cached")."""


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
            time_preparation(name, spec, corpus, size, scratch / "prepare-cache", PREPARE_REPEATS)
            for size, corpus in corpora.items()
            for name, spec in tokenizers.items()
            if name != "BPE" or size <= BPE_MAX_MB
        ]
        cache = scratch / "cache"
        launches, failures = time_launches(
            CONFIG,
            corpora,
            ranks,
            settings.rounds,
            overrides=lambda corpus, count: launch_sets(corpus, cache, max(1, settings.threads // count)),
            cache=cache,
            run_root=RUN_DIR,
            warm_up=warm_up,
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


def launch_sets(corpus: Path, cache: Path, threads: int) -> list[str]:
    """The overrides of every launch: the corpus on the byte tokenizer, its own cache, a short run."""
    return [
        f"data.path={corpus}",
        "data.tokenizer=byte",
        f"data.cache_dir={cache}",
        *run_overrides(STEPS, 1, eval_batches=1, threads=threads),
    ]


# The result


def data_result(
    preparations: list[Preparation],
    launches: Launches,
    failures: dict[str, str],
    sizes: tuple[float, ...],
    ranks: tuple[int, ...],
    rounds: int,
    machine: dict[str, Any],
) -> Result:
    """Rows, largest corpus first: each rank's peak RSS and the launch times against the smallest
    corpus, whether the largest trains on the most ranks, then preparation against its baseline."""
    rows = _memory_rows(launches, sizes, ranks) + _launch_rows(launches, sizes, ranks)
    rows.append(_trained_row(launches, sizes[-1], max(ranks)))
    for preparation in sorted(preparations, key=lambda p: -p.size_mb):
        rows += _preparation_rows(preparation)
    return Result(
        name="data",
        title="Tokenized corpora: preparation speed, launch time and memory per rank against corpus size",
        baseline="baseline",
        method=_method(sizes, rounds),
        rows=rows,
        panels=_panels(launches, sizes, ranks),
        machine=machine,
        failures=failures,
    )


def _memory_rows(launches: Launches, sizes: tuple[float, ...], ranks: tuple[int, ...]) -> list[Row]:
    """Each rank's peak RSS on every larger corpus against the smallest, on the same ranks."""
    smallest, rows = sizes[0], []
    for count in ranks:
        for size in sorted(sizes[1:], reverse=True):
            for rank in range(count):
                base, peak = _peak(launches, smallest, count, rank), _peak(launches, size, count, rank)
                if base is not None and peak is not None:
                    quantity = f"{_versus(count, size, smallest)}: rank {rank} peak RSS, MiB"
                    rows.append(compare(quantity, base / MIB, peak / MIB, RSS_GOAL))
    return rows


def _launch_rows(launches: Launches, sizes: tuple[float, ...], ranks: tuple[int, ...]) -> list[Row]:
    """Cached, then first, launches to step 1 on every larger corpus against the smallest."""
    smallest, rows = sizes[0], []
    for kind, goal in (("cached", CACHED_LAUNCH_GOAL), ("first", None)):
        for count in ranks:
            for size in sorted(sizes[1:], reverse=True):
                base, here = launches.get((smallest, count, kind)), launches.get((size, count, kind))
                if base is not None and here is not None:
                    quantity = f"{_versus(count, size, smallest)}: {kind} launch to step 1, s"
                    rows.append(compare(quantity, base.seconds_to_step_1, here.seconds_to_step_1, goal))
    return rows


def _versus(ranks: int, size: float, smallest: float) -> str:
    return f"{ranks_label(ranks)}, {size_label(size)} vs {size_label(smallest)}"


def _trained_row(launches: Launches, largest: float, most: int) -> Row:
    """Whether the largest corpus trains all STEPS on the most ranks, first and cached launch alike."""
    trained = [launches.get((largest, most, kind)) for kind in ("first", "cached")]
    steps = min(0 if run is None else run.steps for run in trained)
    return compare(f"{ranks_label(most)}, {size_label(largest)}: steps trained of {STEPS}", STEPS, steps, TRAINS_GOAL)


def _preparation_rows(preparation: Preparation) -> list[Row]:
    name, size, tokens = preparation.tokenizer, preparation.size_mb, preparation.tokens
    engine_s, baseline_s = preparation.engine_s, preparation.baseline_s
    head = f"{name}, {size_label(size)}: prepare"
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


def _method(sizes: tuple[float, ...], rounds: int) -> str:
    labels = ", ".join(map(size_label, sizes))
    return (
        f"Corpora of {labels} (tinyshakespeare repeated, made at run time). Preparation: `prepare_text` into an "
        f"empty cache, best of {PREPARE_REPEATS}, alternating with its baseline in one process: for byte and "
        "char, reading the file into a uint8 array (the floor of any preparation, and a byte tokenizer's "
        f"whole work); for BPE (byte-level, {BPE_VOCAB} ids, trained on tinyshakespeare at run time; up to "
        f"{size_label(BPE_MAX_MB)} only, for time), the tokenizer's own `encode_batch_fast` on the engine's "
        "batches of pieces, cut before the clock starts. Launches: `./launch.sh --nproc N "
        f"{CONFIG.relative_to(ROOT)}` on the byte tokenizer, {STEPS} steps, timed from launch.sh's start to "
        "the time stamp of the first metrics record (step 1), the median of "
        f"{rounds} round{'s' if rounds > 1 else ''}; a first launch finds an empty cache, which its `validate` "
        "fills before any rank starts, a cached launch finds it filled; an unmeasured warm-up launch goes "
        f"first. Peak RSS: each rank process's VmHWM, read from /proc every {POLL_S * 1000:.0f} ms, its "
        "largest over the first and cached launches of every round. Launch and memory rows compare each "
        f"corpus with the {size_label(sizes[0])} one on the same ranks. " + BEFORE
    )


def _panels(launches: Launches, sizes: tuple[float, ...], ranks: tuple[int, ...]) -> list[Panel]:
    return [
        Panel(
            title="data: peak RSS per rank",
            xlabel="corpus MB",
            ylabel="MiB",
            series={
                f"{ranks_label(count)}: rank {rank}": _points(
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
                f"{ranks_label(count)}, {kind}": _points(
                    sizes, [_seconds(launches.get((size, count, kind))) for size in sizes], 1
                )
                for count in ranks
                for kind in ("first", "cached")
            },
        ),
    ]


def _peak(launches: Launches, size: float, ranks: int, rank: int) -> int | None:
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
