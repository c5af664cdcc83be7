"""Benchmark 10: chat fine-tuning with LoRA, the engine beside TRL's `SFTTrainer`, the field's own tool.

configs/sft_llama_tiny.json on the project's chat sample: the tiny Llama that transformers writes
(bench/tiny_llama.py, into the benchmark's folder), its ChatML template, conversations packed into
windows, loss on the assistant's tokens, LoRA through peft, one process on the CPU. TRL trains the
same recipe, read from the same config (bench/trl_sft.py). Goals: tokens/s at least TRL's, and the
training loss equal within the spread over seeds.

Each round runs both as their users run them, in fresh processes one after the other: the engine
through the `deepspeed` launcher (engine/main.py with the config), TRL's trainer in a script of its
own. The order alternates by round, and round k starts both sides from seed + k. TRL's loop cannot
take turns with the engine's inside one process as benchmarks 1-3 do (bench/paired.py), so a change
in the load of a shared machine falls on one side's trial: the report states the load average.

Both sides log every step, and each is timed from the wall clock of its log records over windows of
--log-interval steps: the first window (start-up) and the one holding the last step (the engine's
final evaluation) are not timed. Speed counts conversation tokens, padding excluded, since the sides
pack differently: the engine fills each window greedily in file order and pads its tail, TRL packs by
best fit and trains without padding. TRL reports its count (`num_tokens`); the engine's comes from
its packed windows and the sampler's order (data/sharding.py), which depend on the seed alone.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.tiny_llama import write_tiny_llama
from bench.trials import ROOT, RUNS, launch_engine, median, run_logged, run_overrides
from bench.trl_sft import TRL_RESULT
from data.sharding import global_batch_indices
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data

CONFIG = ROOT / "configs" / "sft_llama_tiny.json"
# Where the config has no model.lora: rank 8 on every linear layer but the head, peft's common choice, which
# moves the random base's loss further in a short run than the attention's query and value alone.
LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
SPEED_GOAL = Goal("ratio", ">=", 1.0)
LOSS_GOAL = "equal within the spread over seeds"
BASELINE = "TRL SFTTrainer"


@dataclass(frozen=True)
class Trial:
    """One side's run: per logged step (every step) its wall clock, training loss and the
    conversation tokens it trained on."""

    times: list[float]
    losses: list[float]
    tokens: list[int]


def sample_tokens(lengths: np.ndarray, windows: np.ndarray | None) -> np.ndarray:
    """Conversation tokens in each training sample, padding excluded: a sample's own conversation, or
    the conversations `windows[w]` to `windows[w + 1]` of packed window w (data/chat/samples.py)."""
    if windows is None:
        return np.asarray(lengths, dtype=np.int64)
    ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return ends[windows[1:]] - ends[windows[:-1]]


def engine_step_tokens(per_sample: np.ndarray, steps: int, global_batch: int, seed: int) -> list[int]:
    """The conversation tokens of each of the engine's first `steps` steps, from the samples its
    sampler draws at each (the same arithmetic as data/loader.py's)."""
    return [
        int(per_sample[global_batch_indices(len(per_sample), step, global_batch, seed)].sum()) for step in range(steps)
    ]


def window_rates(trial: Trial, window: int) -> list[float]:
    """Tokens per second over each window of `window` steps, from the wall clock of its log records.
    Not timed: the first window (start-up) and the one that holds the last step (the engine's final
    evaluation runs before that step's record)."""
    steps = len(trial.times)
    return [
        sum(trial.tokens[start : start + window]) / (trial.times[start + window - 1] - trial.times[start - 1])
        for start in range(window, steps - window, window)
    ]


def last_window_loss(trial: Trial, window: int) -> float:
    """The mean training loss of the last `window` steps: one step's loss is one batch's."""
    return statistics.fmean(trial.losses[-window:])


def within_seed_noise(engine: Sequence[float], baseline: Sequence[float]) -> bool | None:
    """Whether the sides' medians differ by no more than the wider of their spreads over seeds;
    None with a single round, which has no spread."""
    if min(len(engine), len(baseline)) < 2:
        return None
    spread = max(max(engine) - min(engine), max(baseline) - min(baseline))
    return abs(median(list(engine)) - median(list(baseline))) <= spread


def base_model(folder: Path) -> Path:
    """The tiny Llama the runs fine-tune, written once by transformers into a folder under `folder`, with
    the context the config gives its model (a directory that disagrees with a written field is refused)."""
    config = load_config(CONFIG, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    positions = config.document["model"]["max_position_embeddings"]
    base = folder / f"base-{positions}"
    if not (base / "config.json").is_file():
        base.mkdir(parents=True, exist_ok=True)
        write_tiny_llama(base, max_position_embeddings=positions)
    return base


def recipe(base: Path) -> list[str]:
    """What the runs are told on top of the config: fine-tune `base` on its own tokenizer and chat
    template, with LoRA (the config's, or LORA where it has none)."""
    sets = [f"model.init_from={base}", f"data.tokenizer={base}", "data.chat_template=null"]
    config = load_config(CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    return sets if config.document["model"].get("lora") else [*sets, f"model.lora={json.dumps(LORA)}"]


def every_step(steps: list[int], run_dir: Path) -> None:
    """Both sides log every step: the windows are counted in records."""
    if steps != list(range(1, len(steps) + 1)):
        raise RuntimeError(f"{run_dir}: logged steps {steps[:5]}... where every step was to be logged")


def engine_trial(overrides: list[str], run_dir: Path) -> Trial:
    records = launch_engine(CONFIG, overrides, run_dir, processes=1)
    every_step([r["step"] for r in records], run_dir)
    config = load_config(CONFIG, overrides, world_size=1, hardware=detect_hardware(local_world_size=1))
    train = load_data(config).train
    per_sample = sample_tokens(train.selection.lengths, getattr(train, "windows", None))
    tokens = engine_step_tokens(per_sample, len(records), config.batch.train_batch_size, config.trainer.seed)
    return Trial([r["time"] for r in records], [r["loss"] for r in records], tokens)


def trl_trial(overrides: list[str], run_dir: Path) -> Trial:
    run_logged([sys.executable, "-m", "bench.trl_sft", "--config", str(CONFIG)], overrides, run_dir)
    result = json.loads((run_dir / TRL_RESULT).read_text())
    every_step(result["steps"], run_dir)
    tokens = np.diff(result["tokens"], prepend=0).tolist()
    return Trial(result["times"], result["losses"], tokens)


def run(settings: Settings) -> Result:
    window, folder = settings.log_interval, RUNS / "sft"
    if settings.steps < 3 * window:
        raise RuntimeError(f"--steps {settings.steps} leaves no window of {window} steps to time: run {3 * window}")
    sets = recipe(base_model(folder))
    common = [*run_overrides(settings.steps, 1, eval_batches=1, threads=settings.threads), *sets]
    seed = load_config(CONFIG, common, world_size=1, hardware=detect_hardware(local_world_size=1)).trainer.seed
    load_before = os.getloadavg()[0]
    trials: dict[str, list[Trial]] = {"engine": [], BASELINE: []}
    sides = [("engine", engine_trial), (BASELINE, trl_trial)]
    for number in range(settings.rounds):
        overrides = [*common, f"trainer.seed={seed + number}"]
        for side, run_side in sides if number % 2 == 0 else reversed(sides):
            label = "engine" if side == "engine" else "trl"
            trials[side].append(run_side(overrides, folder / f"{label}-{number}"))
        engine, trl = trials["engine"][-1], trials[BASELINE][-1]
        engine_rate, trl_rate = (statistics.median(window_rates(trial, window)) for trial in (engine, trl))
        print(
            f"  round {number + 1}/{settings.rounds}: engine {engine_rate:,.0f} tokens/s, TRL {trl_rate:,.0f} "
            f"tokens/s, ratio {engine_rate / trl_rate:.3f}; loss over the last {window} steps: engine "
            f"{last_window_loss(engine, window):.4f}, TRL {last_window_loss(trl, window):.4f}",
            flush=True,
        )
    shown = [set_.replace(str(ROOT) + "/", "") for set_ in sets]
    return sft_result(trials, settings, shown, (load_before, os.getloadavg()[0]))


def sft_result(
    trials: dict[str, list[Trial]], settings: Settings, sets: list[str], load: tuple[float, float]
) -> Result:
    """The rows and loss curves of the rounds' trials."""
    window = settings.log_interval
    rates = {side: [statistics.median(window_rates(trial, window)) for trial in runs] for side, runs in trials.items()}
    losses = {side: [last_window_loss(trial, window) for trial in runs] for side, runs in trials.items()}
    per_step = {side: statistics.fmean(t for trial in runs for t in trial.tokens) for side, runs in trials.items()}
    engine_loss, trl_loss = median(losses["engine"]), median(losses[BASELINE])
    verdict = within_seed_noise(losses["engine"], losses[BASELINE])
    by_round = "; ".join(f"{e:.4f}, {b:.4f}" for e, b in zip(losses["engine"], losses[BASELINE], strict=True))
    first = {side: runs[0] for side, runs in trials.items()}
    return Result(
        name="sft",
        title="Chat fine-tuning with LoRA against TRL's SFTTrainer",
        baseline=BASELINE,
        method=(
            f"{CONFIG.relative_to(ROOT)} with {', '.join(sets)} (the tiny Llama written by transformers, its ChatML "
            "template, the project's chat sample packed, loss on the assistant's tokens, LoRA), one process, "
            f"{settings.threads} threads, {settings.steps} steps logged every step, {settings.rounds} round(s). Each "
            "round runs the engine (deepspeed launcher, engine/main.py) and TRL 1.16's SFTTrainer on the same recipe "
            "(bench/trl_sft.py: AdamW at a constant rate, fp32, no activation checkpointing, best-fit packing without "
            "padding, assistant-only loss through a template that renders the same text) in fresh processes one "
            "after the other, the order alternating and round k seeded seed + k. Speed: conversation tokens per "
            f"second, padding excluded, over {window}-step windows timed by the log records' wall clock, the first "
            "and the last not timed; the median window, then the median over rounds (ratio: the median of the "
            f"rounds' ratios). Conversation tokens per step: engine {per_step['engine']:.0f}, TRL "
            f"{per_step[BASELINE]:.0f} (the engine's greedy windows against TRL's best fit). Loss: the mean training "
            f"loss of the last {window} steps; by round (engine, TRL): {by_round}; the goal asks the medians to "
            "differ by no more than the wider spread over seeds. Not a paired trial: load average "
            f"{load[0]:.2f} at the start, {load[1]:.2f} at the end."
        ),
        rows=[
            compare(
                "conversation tokens/s",
                median(rates[BASELINE]),
                median(rates["engine"]),
                SPEED_GOAL,
                ratio=median([e / b for e, b in zip(rates["engine"], rates[BASELINE], strict=True)]),
            ),
            Row(
                f"training loss, mean of the last {window} steps",
                trl_loss,
                engine_loss,
                engine_loss / trl_loss,
                LOSS_GOAL,
                verdict,
                "one round has no spread over seeds" if verdict is None else "",
            ),
        ],
        panels=[
            Panel(
                title="sft: training loss (first round)",
                xlabel="step",
                ylabel="cross-entropy on the assistant's tokens",
                series={side: (list(range(1, len(trial.losses) + 1)), trial.losses) for side, trial in first.items()},
            )
        ],
        machine=machine_facts(settings.threads),
    )
