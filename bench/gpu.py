"""Benchmark 5, on one CUDA GPU: GPT-2 124M in bf16 at sequence 1024 and a Llama of about 1B
parameters at sequence 4096, and the largest GPT that trains on the GPU with ZeRO-Offload.

`gpu`: tokens/s and MFU of the engine with and without `trainer.compile`, with SDPA and eager
attention, with activation checkpointing, and under `torch_autocast` instead of bf16 weights,
each beside nanoGPT's recipe with the same model and settings as the baseline (the minimal PyTorch
loop of benchmark 1 with bf16 autocast and fused AdamW, compiled when the engine compiles). Goals:
engine/loop >= 0.98 on every row; MFU >= 45% for GPT-2 124M and >= 50% for the 1B Llama on an
H100/H200-class GPU (TinyLlama reported 56% for 1.1B on A100). GPT-2's vocabulary is padded to
50304 as nanoGPT pads it (a multiple of 64 keeps the head's matmul on fast tiles); the Llama is
`configs/llama_1b.json` (Llama 3.2 1B's shape and 128,256-token vocabulary). The data are
synthetic tokens, which cost the same to train on as text.

`offload`: GPT sizes from GPT-2 XL up, each with ZeRO-2 and its optimizer offloaded to host
memory (ZeRO-Offload), bf16, activation checkpointing and micro-batch 1. The planner
(`engine/plan`) skips sizes whose states cannot fit the GPU or this host; the rest are launched
from the largest down until one trains. Its size is compared with the largest the planner fits
on the same GPU without offload.

Both need a CUDA device and report themselves unavailable without one; there, `python -m bench
offload` runs bench/infinity.py instead (ZeRO-3's NVMe offload against its CPU offload under a cap
on host memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from bench.machine import machine_facts
from bench.memory import parameter_count
from bench.results import Goal, Panel, Result, Row, Unavailable, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, Pair, Side, launch_engine, median, rounds, run_overrides
from engine.config import load_config
from engine.launch.hardware import detect_hardware, device_peak_flops
from engine.observability.flops import mfu
from engine.plan import plan_run
from engine.preflight import check_data
from models import get_family

CONFIG = ROOT / "configs" / "gpt2_124m.json"
COMMON = [
    "data.type=synthetic",
    "model.vocab_size=50304",
    "data.seq_len=1024",
    "bf16.enabled=true",
    "zero_optimization.stage=0",
    "train_micro_batch_size_per_gpu=16",
    "gradient_accumulation_steps=1",
    "train_batch_size=16",
    "scheduler.params.warmup_num_steps=10",
]
BASELINE = "nanoGPT-style loop"
RATIO_GOAL = Goal("ratio", ">=", 0.98)
VARIANTS = {
    "eager, SDPA": ["trainer.compile=false"],
    "compiled, SDPA": ["trainer.compile=true"],
    "compiled, eager attention": ["trainer.compile=true", "model.attn_implementation=eager"],
    "compiled, SDPA, activation checkpointing": ["trainer.compile=true", "model.activation_checkpointing=true"],
    "compiled, SDPA, torch_autocast": ["trainer.compile=true", "bf16.enabled=false", "torch_autocast.enabled=true"],
}
LLAMA_CONFIG = ROOT / "configs" / "llama_1b.json"
# Micro-batch 2 without activation checkpointing: the engine and the loop share one GPU in a paired
# trial, two copies of the weights, gradients and Adam states (about 20 GB each).
LLAMA_COMMON = [
    "data.seq_len=4096",
    "bf16.enabled=true",
    "zero_optimization.stage=0",
    "model.activation_checkpointing=false",
    "train_micro_batch_size_per_gpu=2",
    "gradient_accumulation_steps=1",
    "train_batch_size=2",
    "scheduler.params.warmup_num_steps=10",
]
LLAMA_VARIANTS = {
    "eager, SDPA": ["trainer.compile=false"],
    "compiled, SDPA": ["trainer.compile=true"],
    "compiled, SDPA, activation checkpointing": ["trainer.compile=true", "model.activation_checkpointing=true"],
}


@dataclass(frozen=True)
class Subject:
    """A model benchmark 5 measures: its config, the settings every variant shares, the variants."""

    label: str
    config: Path
    common: list[str]
    variants: dict[str, list[str]]
    mfu_goal: Goal


SUBJECTS = (
    Subject("GPT-2 124M", CONFIG, COMMON, VARIANTS, Goal("engine", ">=", 0.45)),
    Subject("Llama 1B", LLAMA_CONFIG, LLAMA_COMMON, LLAMA_VARIANTS, Goal("engine", ">=", 0.5)),
)
# (layers, width, heads): GPT-2 XL, then GPT-3's 2.7B, 6.7B, 13B and 20B-class shapes.
OFFLOAD_SIZES = [(48, 1600, 25), (32, 2560, 32), (32, 4096, 32), (40, 5120, 40), (44, 6144, 48)]
OFFLOAD = [
    "data.type=synthetic",
    "model.vocab_size=50304",
    "data.seq_len=1024",
    "bf16.enabled=true",
    "model.activation_checkpointing=true",
    "train_micro_batch_size_per_gpu=1",
    "gradient_accumulation_steps=1",
    "train_batch_size=1",
    "scheduler.params.warmup_num_steps=2",
]
OFFLOADED = [
    "zero_optimization.stage=2",
    "zero_optimization.offload_optimizer.device=cpu",
    "zero_optimization.offload_optimizer.pin_memory=true",
]


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        raise Unavailable("needs a CUDA GPU; run it on one (the `device` tool lends an H200 to some tasks)")


def speed(settings: Settings) -> Result:
    _require_gpu()
    steps = max(settings.steps, 60)  # compilation takes the first steps, which the first window holds
    measured: dict[str, dict[str, list[Pair]]] = {}
    failures: dict[str, str] = {}
    for subject in SUBJECTS:
        pairs, failed = measure(subject, list(subject.variants), steps, settings.rounds, settings.threads)
        measured[subject.label] = pairs
        failures.update(failed)
    return speed_result(measured, failures, steps)


def measure(
    subject: Subject, variants: list[str], steps: int, count: int, threads: int
) -> tuple[dict[str, list[Pair]], dict[str, str]]:
    """`count` paired trials of each of `subject`'s `variants`, and the variants that failed (keyed
    "<subject>, <variant>"), with why: one variant's failure (a kernel, a compile error, memory)
    should not cost the others' figures."""
    overrides = run_overrides(steps, 10, eval_batches=1, threads=threads)
    measured: dict[str, list[Pair]] = {}
    failures: dict[str, str] = {}
    for name in variants:
        label = f"{subject.label}-{name}".replace(", ", "-").replace(" ", "-")
        try:
            sets = [*subject.common, *subject.variants[name], *overrides]
            measured[name] = rounds("torch", subject.config, sets, count, RUNS / "gpu", label)
        except RuntimeError as error:
            failures[f"{subject.label}, {name}"] = str(error)
            print(f"  {subject.label}, {name}: failed: {error}", flush=True)
    return measured, failures


def flops_per_token(subject: Subject) -> int:
    """Model FLOPs per trained token (6N and attention, the family's count) of `subject`'s settings."""
    hardware = detect_hardware(local_world_size=1)
    config = load_config(subject.config, [*subject.common, "trainer.compile=false"], world_size=1, hardware=hardware)
    family = get_family(config.model.family)
    return family.flops_per_item(family.architecture(config.model.fields), config.data.as_mapping())


def speed_result(
    measured: dict[str, dict[str, list[Pair]]],
    failures: dict[str, str],
    steps: int,
    flops: dict[str, int] | None = None,
    peak: float | None = None,
) -> Result:
    """Rows and plot of the paired trials (`measured`: subject label -> variant -> pairs); `failures`
    names the variants that did not train, and why. `flops` (per token, by subject) and `peak`
    default to each subject's count and this GPU's dense bf16 peak."""
    if not any(measured.values()):
        raise RuntimeError("no variant trained: " + "; ".join(f"{name}: {why}" for name, why in failures.items()))
    if flops is None:
        flops = {subject.label: flops_per_token(subject) for subject in SUBJECTS if measured.get(subject.label)}
    if peak is None and torch.cuda.is_available():
        peak = device_peak_flops(torch.cuda.get_device_name(), "bf16")
    rows: list[Row] = []
    series: dict[str, tuple[list[float], list[float]]] = {}
    names: list[str] = []
    for subject in SUBJECTS:
        for name, pairs in measured.get(subject.label, {}).items():
            rows.extend(_rows(f"{subject.label}, {name}", pairs, flops[subject.label], peak, subject.mfu_goal))
            for side in ("engine", "baseline"):
                xs, ys = series.setdefault(BASELINE if side == "baseline" else side, ([], []))
                xs.append(len(names))
                ys.append(median([getattr(p, side).tokens_per_s for p in pairs]))
            names.append(f"{subject.label}, {name}")
    trials = len(next(pairs for per_subject in measured.values() for pairs in per_subject.values()))
    machine = next(pairs for per_subject in measured.values() for pairs in per_subject.values())[0].machine
    settings = "; ".join(
        f"{subject.label}: {subject.config.relative_to(ROOT)} with {', '.join(subject.common)}" for subject in SUBJECTS
    )
    return Result(
        name="gpu",
        title="GPT-2 124M and a 1B Llama on one GPU: tokens/s and MFU",
        baseline=BASELINE,
        method=(
            f"{settings}. {trials} round(s) per variant, each a fresh process in which the engine and the loop "
            f"alternate window by window for {steps} steps (bench/paired.py), speed from the median 10-step "
            "window after the first (which holds compilation). MFU = 6N + attention FLOPs per token (the model "
            "family's count) x tokens/s / the GPU's dense bf16 peak. "
            "Variants, x axis of the plot: " + "; ".join(f"{i} {name}" for i, name in enumerate(names)) + "."
        ),
        rows=rows,
        panels=[Panel(title="gpu: tokens/s by variant", xlabel="variant", ylabel="tokens/s", series=series)],
        machine=machine,
        failures=failures,
    )


def _rows(label: str, pairs: list[Pair], flops: int, peak: float | None, mfu_goal: Goal) -> list[Row]:
    """A variant's tokens/s row (judged on engine/loop) and MFU row (judged on the engine's MFU)."""

    def mfu_of(side: Side) -> float:
        return float("nan") if peak is None else mfu(flops, side.tokens_per_s, peak, world_size=1)

    return [
        compare(
            f"{label}: tokens/s",
            median([p.baseline.tokens_per_s for p in pairs]),
            median([p.engine.tokens_per_s for p in pairs]),
            RATIO_GOAL,
            ratio=median([p.ratio for p in pairs]),
        ),
        compare(
            f"{label}: MFU",
            median([mfu_of(p.baseline) for p in pairs]),
            median([mfu_of(p.engine) for p in pairs]),
            mfu_goal,
            not_judged=None if peak is not None else "no peak FLOP/s known for this GPU",
        ),
    ]


def offload(settings: Settings) -> Result:
    _require_gpu()
    device_memory = torch.cuda.get_device_properties(0).total_memory
    host_memory = psutil.virtual_memory().total
    overrides = run_overrides(3, 1, eval_batches=1, threads=settings.threads)

    def sized(size: tuple[int, int, int], layout: list[str]) -> list[str]:
        layers, width, heads = size
        return [*OFFLOAD, *layout, f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"]

    def fits(sets: list[str]) -> bool:
        config = load_config(CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
        plan = plan_run(check_data(config)[0])
        return plan.device_peak <= device_memory and plan.host_total <= host_memory

    plain = [size for size in OFFLOAD_SIZES if fits(sized(size, ["zero_optimization.stage=0"]))]
    without = parameter_count(CONFIG, sized(plain[-1], [])) if plain else 0
    for size in reversed([size for size in OFFLOAD_SIZES if fits(sized(size, OFFLOADED))]):
        run_dir = RUNS / "offload" / "x".join(map(str, size))
        try:
            records = launch_engine(CONFIG, [*sized(size, OFFLOADED), *overrides], run_dir, processes=1)
        except RuntimeError as error:
            print(f"  {size}: did not train: {str(error).splitlines()[0]}", flush=True)
            continue
        break
    else:
        raise RuntimeError("no GPT size trained with ZeRO-Offload on this GPU")
    parameters = parameter_count(CONFIG, sized(size, []))
    return Result(
        name="offload",
        title="The largest GPT that trains on one GPU with ZeRO-Offload",
        baseline="without offload (planned)",
        method=(
            f"Sizes (layers, width, heads) {OFFLOAD_SIZES} with {', '.join(OFFLOAD + OFFLOADED)}, 3 steps each; "
            f"the planner drops sizes that cannot fit {device_memory / 2**30:.0f} GiB of GPU or "
            f"{host_memory / 2**30:.0f} GiB of host memory, and the rest are launched from the largest down. "
            f"The largest, {size}, trained at {records[-1]['tokens_per_s']:,.0f} tokens/s. Baseline: the largest "
            "size the planner fits without offload (ZeRO-0, same settings)."
        ),
        rows=[compare("parameters trained", without or float("nan"), parameters)],
        panels=[],
        machine=machine_facts(settings.threads),
    )
