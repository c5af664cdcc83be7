"""Benchmark 3: quality and speed on real text. nanoGPT's "baby GPT" on tinyshakespeare, characters
(4 layers, 4 heads, width 128, context 64, batch 12, AdamW at 1e-3 with 100 linear warm-up steps
and a cosine to 1e-4, beta2 0.99, weight decay 0.1 on the matrices, clipping 1.0, no dropout, windows at
every offset as nanoGPT samples them: configs/shakespeare_char.json),
trained by the engine and by the minimal PyTorch loop of benchmark 1 from the same weights on the
same batches, step for step in one process. Goals: validation loss <= 1.89 at step 2000, and
seconds per step within 5% of the loop.

The loss goal is nanoGPT's published figure for this recipe. To calibrate it, nanoGPT's own model
and loop (bench/nanogpt.py) train the same recipe in a process of their own and are validated on
the same samples; the report prints the engine's loss against it.

The corpus (../shared/data/tinyshakespeare.txt, not committed) is split as nanoGPT splits it: the
first 90% of its characters train, the last 10% validate (data/text.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import NamedTuple

from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, Pair, median, rounds, run_overrides
from engine.config import EngineConfig, load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data

CONFIG = ROOT / "configs" / "shakespeare_char.json"
GOAL_STEP = 2000
LOSS_GOAL = Goal("engine", "<=", 1.89)
SPEED_GOAL = Goal("ratio", "<=", 1.05)
BASELINE = "PyTorch loop"
NANOGPT_SEED = 1337  # nanoGPT's default; round k uses NANOGPT_SEED + k


class ValidationSplit(NamedTuple):
    batches: int  # micro-batches that cover the split once, but for a remainder under one micro-batch
    micro_batch: int
    seq_len: int
    samples: int  # samples in the split, seq_len inputs and their next tokens each


def validation_split(config: EngineConfig) -> ValidationSplit:
    """How many evaluation batches cover the whole validation split (the engine evaluates a fixed
    number of micro-batches, cycling the split if asked for more)."""
    samples = len(load_data(config).validation)
    micro_batch = config.batch.micro_batch_size
    return ValidationSplit(samples // micro_batch, micro_batch, config.data.seq_len, samples)


def nanogpt_loss(steps: int, samples: int, threads: int, seed: int) -> float:
    """nanoGPT's validation loss on the engine's first `samples` validation samples (bench/nanogpt.py)."""
    out = RUNS / "shakespeare" / f"nanogpt-{seed}.json"
    command = [sys.executable, "-m", "bench.nanogpt", "--config", str(CONFIG), "--steps", str(steps)]
    command += ["--seed", str(seed), "--samples", str(samples), "--threads", str(threads), "--out", str(out)]
    code = subprocess.run(command, cwd=ROOT).returncode
    if code != 0:
        # RuntimeError, as a failed engine trial raises: the other benchmarks still report.
        raise RuntimeError(f"bench.nanogpt exited {code}; its output is above")
    return json.loads(out.read_text())["eval_loss"]


def run(settings: Settings) -> Result:
    steps = settings.quality_steps
    config = load_config(CONFIG, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    split, seed = validation_split(config), config.trainer.seed
    log_interval = max(1, steps // 20)
    overrides = run_overrides(steps, log_interval, split.batches, settings.threads)
    pairs = rounds(
        "torch",
        CONFIG,
        overrides,
        settings.quality_rounds,
        RUNS / "shakespeare",
        "shakespeare",
        per_round=lambda number: [f"trainer.seed={seed + number}"],
    )
    nanogpt = [
        nanogpt_loss(steps, split.batches * split.micro_batch, settings.threads, NANOGPT_SEED + number)
        for number in range(settings.quality_rounds)
    ]
    print(f"  nanoGPT's own model and loop: validation loss {median(nanogpt):.4f}", flush=True)
    by_round = "; ".join(
        f"{pair.engine.eval_loss:.3f}, {pair.baseline.eval_loss:.3f}, {own:.3f}"
        for pair, own in zip(pairs, nanogpt, strict=True)
    )
    return Result(
        name="shakespeare",
        title="Character-level GPT on tinyshakespeare: quality and speed",
        baseline=f"{BASELINE} (nanoGPT's own code in the last row)",
        method=method(settings, split, seed, log_interval, by_round),
        rows=rows(pairs, nanogpt, steps),
        panels=[loss_panel(pairs[0], nanogpt[0], steps)],
        machine=pairs[0].machine,
    )


def rows(pairs: list[Pair], nanogpt: list[float], steps: int) -> list[Row]:
    """Speed and validation loss against the loop, medians over rounds; the loss against nanoGPT's."""
    early = None if steps == GOAL_STEP else f"the goal is stated at step {GOAL_STEP}; this run stopped at {steps}"
    return [
        compare(
            "seconds per step",
            median([p.baseline.seconds_per_step for p in pairs]),
            median([p.engine.seconds_per_step for p in pairs]),
            SPEED_GOAL,
            ratio=median([1 / p.ratio for p in pairs]),
        ),
        compare(
            f"validation loss at step {steps}",
            median([p.baseline.eval_loss for p in pairs]),
            median([p.engine.eval_loss for p in pairs]),
            LOSS_GOAL,
            not_judged=early,
        ),
        compare(
            f"validation loss at step {steps}, against nanoGPT's own code",
            median(nanogpt),
            median([p.engine.eval_loss for p in pairs]),
        ),
    ]


def loss_panel(first: Pair, nanogpt: float, steps: int) -> Panel:
    """The first round's training curves and final validation losses, the goal drawn across."""
    sides = {"engine": first.engine, BASELINE: first.baseline}
    curves = {f"{side} training": tuple(map(list, zip(*sides[side].losses, strict=True))) for side in sides}
    finals = {f"{side} validation": ([steps], [sides[side].eval_loss]) for side in sides}
    finals["nanoGPT validation"] = ([steps], [nanogpt])
    return Panel(
        title="shakespeare: loss (first round)",
        xlabel="step",
        ylabel="cross-entropy",
        series={**curves, **finals},
        goal_line=LOSS_GOAL.limit,
    )


def method(settings: Settings, split: ValidationSplit, seed: int, log_interval: int, by_round: str) -> str:
    """How the figures were made; `by_round` lists each round's validation losses."""
    steps = settings.quality_steps
    return (
        f"{CONFIG.relative_to(ROOT)} for {steps} steps (LR schedule over the same {steps}), one process, "
        f"{settings.threads} threads, {settings.quality_rounds} round(s), each a fresh process in which the engine "
        "and the loop alternate window by window (bench/paired.py), the engine logging every "
        f"{log_interval} steps; speed is the median {log_interval}-step window after the first. Validation loss "
        f"after the last step over {split.batches} batches of {split.micro_batch} samples of "
        f"{split.seq_len} characters, each scored on the character after every one of them, cut every "
        f"{split.seq_len} characters: {split.batches * split.micro_batch} of the {split.samples} samples of "
        "the last 10% of the text, in order. Weight decay reaches the matrices only (trainer.weight_decay_on). "
        "nanoGPT's own model and loop (bench/nanogpt.py: no biases, no decay on gains, windows drawn at random "
        "offsets with replacement) "
        f"train the same recipe, seed {NANOGPT_SEED} + round, in a process of their own, and are validated "
        f"on the same samples. The engine and the loop start from seed {seed} + round. Validation loss by round "
        f"(engine, loop, nanoGPT): {by_round}."
    )
