"""Benchmark 12: the memory walls of a large vocabulary (issue 44): peak memory and step time of a
training step with the full logits' loss and with the fused loss, at micro-batches 1, 2 and 4, and
for each activation-checkpointing choice, with the planner's estimate beside every measured figure.

A Llama (configs/llama_tiny.json widened to hidden 256, 4 query and 2 key/value heads, intermediate
688, 2 layers) with Llama 3's vocabulary of 128,256 trains on synthetic tokens at LENGTH tokens per
sequence, fp32, ZeRO-0, on one rank under the `deepspeed` launcher, as bench/sequence.py launches it
(its `launch`: the rank's peak RSS read from /proc, the median step time after the first). The
vocabulary makes the head most of the model (66M of its 67M parameters) and its logits most of a
step: 1 GB of fp32 logits per sequence against tens of MB of hidden states.

Memory, subtracted twice so that only what the loss holds is left:
- activations: a run's peak above the same vocabulary's run at REFERENCE tokens, whose own
  activations are negligible (the interpreter, torch, DeepSpeed and the model states, which a GPU's
  allocator would not count, are in both);
- the loss's share: a run's activations less the body's, the same model at micro-batch and length
  with a vocabulary of SMALL_VOCAB (its logits 0.2% of 128,256's), measured the same way. The body's
  activations do not depend on the vocabulary, so what is left is the logits, their gradients and
  whatever the loss computes from them.
The goal is the issue's: the fused loss's share at most a quarter of the full loss's.

"fused" is Liger-Kernel's fused linear cross-entropy on CUDA; on a CPU it runs the engine's PyTorch
form of it (models/tiling.py `FusedLinearCrossEntropy`): the head's gradients computed in the forward
piece by piece, pieces of at most `models.tile_sizes.LOSS_PIECE_BYTES` of logits, nothing computed
twice. "tiled" (each piece's logits computed again in backward under checkpoint, the form ZeRO-3's
and tensor parallelism's heads take) runs once, at micro-batch 1, against it. The checkpointing choices
(`models.activation_checkpointing.SUGGESTED`) run with the fused loss at micro-batch 1.

The optimizer is SGD without momentum or weight decay, which steps in place: AdamW's step makes
temporaries as large as the head, which raise the REFERENCE run's peak and hid about 0.5 GiB of the
loss's share in this benchmark's first run.

Speed: a step's time (metrics.jsonl's `step_time_s`), over the steps after the first. Goal: fused /
full <= 1.1.

Plan: `python -m engine plan`'s activations (engine/plan, models/costs.py `decoder_activations`)
over the same differences: what transformers' Llama layer saves (SDPA's flash kernel keeps no
scores), one layer's gradients in flight, and what each loss holds.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from typing import Any

from bench.machine import machine_facts
from bench.results import Goal, Panel, Result, Row, compare
from bench.sequence import CONFIG, MIB, Trial, launch
from bench.settings import Settings
from bench.trials import ROOT, RUNS, run_overrides
from engine.checkpoints.store import checkpoint_root
from models.activation_checkpointing import NONE, SUGGESTED, Checkpointing

MODEL = [
    "data.type=synthetic",
    "model.hidden_size=256",
    "model.intermediate_size=688",
    "model.num_attention_heads=4",
    "model.num_key_value_heads=2",
    "model.num_hidden_layers=2",
    # SGD without momentum or decay steps in place: AdamW's step makes temporaries as large as the
    # head, which would raise the short reference run's peak and hide part of the loss's share.
    "optimizer.type=SGD",
    "optimizer.params.momentum=0",
    "optimizer.params.weight_decay=0",
]
VOCAB = 128256  # Llama 3's
SMALL_VOCAB = 256  # the body alone: its logits are negligible beside the model's activations
LENGTH = 2048
REFERENCE = 16  # the length whose peak is a vocabulary's floor: runtime and model states
MICRO_BATCHES = (1, 2, 4)
CHECKPOINTED_BATCH = 1  # the micro-batch of the checkpointing choices
STEPS = 2  # the first allocates Adam's states, so the second is the first at the full peak; it is timed
SHARE_GOAL = Goal("ratio", "<=", 0.25)  # the fused loss's share of peak memory against the full loss's
STEP_GOAL = Goal("ratio", "<=", 1.1)  # fused / full seconds per step


@dataclass(frozen=True)
class Point:
    """One launch: the loss, the micro-batch, and what a reference or a body run changes."""

    loss: str
    micro_batch: int
    vocab: int = VOCAB
    length: int = LENGTH
    checkpointing: Checkpointing = field(default=NONE)

    @property
    def name(self) -> str:
        checkpointing = self.checkpointing.label.replace(", ", "-").replace(" ", "-")
        return f"{self.loss}-v{self.vocab}-t{self.length}-mb{self.micro_batch}-ckpt-{checkpointing}"

    def sets(self, threads: int) -> list[str]:
        """The overrides of this launch."""
        return [
            *MODEL,
            f"model.vocab_size={self.vocab}",
            f"model.max_position_embeddings={LENGTH}",
            f"model.loss={self.loss}",
            f"model.activation_checkpointing={_override(self.checkpointing.value)}",
            f"data.seq_len={self.length}",
            f"train_micro_batch_size_per_gpu={self.micro_batch}",
            *run_overrides(STEPS, 1, eval_batches=1, threads=threads),
        ]


def _override(value: bool | str | dict[str, Any]) -> str:
    """A config value as `--set` reads it: a string bare, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def reference(vocab: int) -> Point:
    return Point("full", 1, vocab=vocab, length=REFERENCE)


def body(micro_batch: int) -> Point:
    return Point("full", micro_batch, vocab=SMALL_VOCAB)


def checkpointed(choice: Checkpointing) -> Point:
    return Point("fused", CHECKPOINTED_BATCH, checkpointing=choice)


def points() -> list[Point]:
    """Every launch, in the order run: full and fused back to back at each micro-batch, so that a
    shared machine's load reaches both."""
    losses = [Point(loss, batch) for batch in MICRO_BATCHES for loss in ("full", "fused")]
    every = [
        reference(VOCAB),
        reference(SMALL_VOCAB),
        *(body(batch) for batch in MICRO_BATCHES),
        *losses,
        Point("tiled", CHECKPOINTED_BATCH),
        *(checkpointed(choice) for choice in SUGGESTED),
    ]
    return list(dict.fromkeys(every))  # the fused run without checkpointing is in both sweeps


def run(settings: Settings) -> Result:
    trials = {point: trial(point, settings.threads) for point in points()}
    return memory_walls_result(trials, machine_facts(settings.threads))


def trial(point: Point, threads: int) -> Trial:
    run_dir = RUNS / "memory-walls" / point.name
    measured = launch(point.sets(threads), 1, run_dir)
    # The run's final save holds 0.8 GB of weights and Adam's states, of no use once measured.
    shutil.rmtree(checkpoint_root(run_dir), ignore_errors=True)
    print(
        f"  {point.name}: {measured.seconds_per_step:.2f} s/step; peak RSS {measured.peak / MIB:,.0f} MiB; "
        f"plan's activations {measured.planned_activations / MIB:,.0f} MiB",
        flush=True,
    )
    return measured


@dataclass(frozen=True)
class Figures:
    """Measured and planned bytes of the points of one run."""

    trials: dict[Point, Trial]

    def activations(self, point: Point, planned: bool = False) -> int:
        """The peak above the same vocabulary's at REFERENCE tokens."""
        return self._bytes(point, planned) - self._bytes(reference(point.vocab), planned)

    def share(self, point: Point, planned: bool = False) -> int:
        """The loss's: the activations above the body's at the same micro-batch."""
        return self.activations(point, planned) - self.activations(body(point.micro_batch), planned)

    def _bytes(self, point: Point, planned: bool) -> int:
        trial = self.trials[point]
        return trial.planned_activations if planned else trial.peak


def memory_walls_result(trials: dict[Point, Trial], machine: dict[str, Any]) -> Result:
    """Rows, largest micro-batch first: the loss's share (the goal), peak RSS and step time, fused
    against full; tiled against fused; each checkpointing choice against none; then measured against
    planned activations and shares."""
    figures = Figures(trials)
    return Result(
        name="memory-walls",
        title="Llama 3's vocabulary on a CPU: the loss's memory, full and fused, and activation checkpointing",
        baseline="baseline",
        method=_METHOD,
        rows=loss_rows(figures) + tiled_rows(trials) + checkpointing_rows(figures) + plan_rows(figures),
        panels=[loss_panel(figures), checkpointing_panel(figures)],
        machine=machine,
    )


def loss_rows(figures: Figures) -> list[Row]:
    """At each micro-batch, largest first: the loss's share (the goal), peak RSS and step time, fused
    against full."""
    trials, rows = figures.trials, []
    for batch in sorted(MICRO_BATCHES, reverse=True):
        full, fused = Point("full", batch), Point("fused", batch)
        rows += [
            compare(
                f"the loss's share of peak memory at micro-batch {batch}, MiB: fused vs full",
                figures.share(full) / MIB,
                figures.share(fused) / MIB,
                SHARE_GOAL,
            ),
            compare(
                f"peak RSS at micro-batch {batch}, MiB: fused vs full",
                trials[full].peak / MIB,
                trials[fused].peak / MIB,
            ),
            compare(
                f"seconds per step at micro-batch {batch}: fused vs full",
                trials[full].seconds_per_step,
                trials[fused].seconds_per_step,
                STEP_GOAL,
            ),
        ]
    return rows


def tiled_rows(trials: dict[Point, Trial]) -> list[Row]:
    """The tiled loss (recomputed in backward) against the fused: peak RSS and step time."""
    fused, tiled = Point("fused", CHECKPOINTED_BATCH), Point("tiled", CHECKPOINTED_BATCH)
    return [
        compare(
            f"micro-batch {CHECKPOINTED_BATCH}, tiled vs fused: peak RSS, MiB",
            trials[fused].peak / MIB,
            trials[tiled].peak / MIB,
        ),
        compare(
            f"micro-batch {CHECKPOINTED_BATCH}, tiled vs fused: seconds per step",
            trials[fused].seconds_per_step,
            trials[tiled].seconds_per_step,
        ),
    ]


def checkpointing_rows(figures: Figures) -> list[Row]:
    """Each checkpointing choice against none: activation memory and step time."""
    none, rows = checkpointed(NONE), []
    for choice in SUGGESTED[1:]:
        point = checkpointed(choice)
        rows += [
            compare(
                f"checkpointing {choice.label} vs off: activation memory, MiB",
                figures.activations(none) / MIB,
                figures.activations(point) / MIB,
            ),
            compare(
                f"checkpointing {choice.label} vs off: seconds per step",
                figures.trials[none].seconds_per_step,
                figures.trials[point].seconds_per_step,
            ),
        ]
    return rows


def plan_rows(figures: Figures) -> list[Row]:
    """Measured against planned: activation memory of every point but the references, the loss's
    share in each sweep, and the memory each checkpointing choice saves."""
    descending = sorted(MICRO_BATCHES, reverse=True)
    sweeps = [Point(loss, batch) for loss in ("full", "fused") for batch in descending]
    planned = [
        *(body(batch) for batch in descending),
        *sweeps,
        Point("tiled", CHECKPOINTED_BATCH),
        *(checkpointed(choice) for choice in SUGGESTED[1:]),
    ]
    rows = [
        compare(
            f"{_described(point)}: activation memory, MiB: measured vs plan",
            figures.activations(point, planned=True) / MIB,
            figures.activations(point) / MIB,
        )
        for point in planned
    ]
    rows += [
        compare(
            f"{point.loss} loss at micro-batch {point.micro_batch}: the loss's share, MiB: measured vs plan",
            figures.share(point, planned=True) / MIB,
            figures.share(point) / MIB,
        )
        for point in sweeps
    ]
    none = checkpointed(NONE)
    return rows + [
        compare(
            f"checkpointing {choice.label}: activation memory saved against off, MiB: measured vs plan",
            (figures.activations(none, planned=True) - figures.activations(checkpointed(choice), planned=True)) / MIB,
            (figures.activations(none) - figures.activations(checkpointed(choice))) / MIB,
        )
        for choice in SUGGESTED[1:]
    ]


def loss_panel(figures: Figures) -> Panel:
    """Peak RSS and the loss's share against micro-batch, full and fused."""
    return Panel(
        title="memory-walls: peak memory against micro-batch",
        xlabel="micro-batch (sequences of 2048 tokens)",
        ylabel="MiB",
        series={
            **{
                f"{loss} loss: peak RSS": (
                    list(MICRO_BATCHES),
                    [figures.trials[Point(loss, b)].peak / MIB for b in MICRO_BATCHES],
                )
                for loss in ("full", "fused")
            },
            **{
                f"{loss} loss: its share": (
                    list(MICRO_BATCHES),
                    [figures.share(Point(loss, b)) / MIB for b in MICRO_BATCHES],
                )
                for loss in ("full", "fused")
            },
        },
    )


def checkpointing_panel(figures: Figures) -> Panel:
    """Each checkpointing choice's step time against its activations less the loss's share."""
    none = checkpointed(NONE)
    return Panel(
        title=f"memory-walls: checkpointing, fused loss, micro-batch {CHECKPOINTED_BATCH}",
        xlabel="seconds per step",
        ylabel="activations less the loss's share, MiB",
        # Less the loss's share without checkpointing (which no choice changes): the loss's
        # 2.5 GB would flatten the tens of MB that checkpointing moves on an axis from zero.
        series={
            choice.label: (
                [figures.trials[checkpointed(choice)].seconds_per_step],
                [(figures.activations(checkpointed(choice)) - figures.share(none)) / MIB],
            )
            for choice in SUGGESTED
        },
    )


def _described(point: Point) -> str:
    if point.vocab != VOCAB:
        return f"the body (vocabulary {point.vocab}) at micro-batch {point.micro_batch}"
    checkpointing = f", checkpointing {point.checkpointing.label}" if point.checkpointing else ""
    return f"{point.loss} loss at micro-batch {point.micro_batch}{checkpointing}"


_METHOD = (
    f"{CONFIG.relative_to(ROOT)} widened to hidden 256 (4 query, 2 key/value heads, intermediate 688, 2 layers) "
    f"with Llama 3's vocabulary of {VOCAB:,} (untied head), fp32, ZeRO-0, SGD without momentum or weight decay "
    f"(it steps in place: AdamW's temporaries would raise the short reference run's peak), synthetic tokens, "
    f"{LENGTH} per sequence, one rank under the `deepspeed` launcher, {STEPS} steps (the second is the one timed), "
    "every core. Peak RSS: the rank's VmHWM over the run, read from /proc every 100 ms (bench/rank_memory.py). "
    f"Activation memory: the peak above the same vocabulary's run at {REFERENCE} tokens (the interpreter, torch, "
    "DeepSpeed and the model states, which a GPU's allocator would not count). The loss's share: the activation "
    f"memory less the body's, the same model and micro-batch at a vocabulary of {SMALL_VOCAB}, whose logits are "
    f"negligible (its own activations above its own {REFERENCE}-token run): what the logits, their gradients and "
    'the loss hold. On a CPU `model.loss` "fused" runs the engine\'s PyTorch fused linear cross-entropy (the '
    'head\'s gradients computed in the forward, pieces of at most 128 MiB of fp32 logits); "tiled" recomputes '
    "each piece's logits in the backward pass under checkpoint. The checkpointing choices run with the fused loss "
    f"at micro-batch {CHECKPOINTED_BATCH}; on a CPU an offloaded input is a copy in the same host memory; their "
    "plot shows each choice's activations less the loss's share without checkpointing. One step is timed per "
    "launch, so a shared machine's load shows in the times. Plan: `python -m engine plan`'s activations over the "
    "same differences (models/costs.py): what transformers' Llama layer saves, one layer's gradients in flight, "
    "and three fp32 logits-sized tensors for the full loss, two pieces and the hidden states' gradient for the "
    "fused."
)
