"""Benchmark 5, on one CUDA GPU: GPT-2 124M in bf16 at sequence 1024, and the largest GPT that
trains on the GPU with ZeRO-Offload.

`gpu`: tokens/s and MFU of the engine with and without `trainer.compile`, with SDPA and eager
attention, with activation checkpointing, and under `torch_autocast` instead of bf16 weights,
each beside nanoGPT's recipe with the same settings as the baseline (the minimal PyTorch loop of
benchmark 1 with bf16 autocast and fused AdamW, compiled when the engine compiles). Goal: MFU >=
50% on an H100/H200-class GPU. The vocabulary is padded to 50304 as nanoGPT pads it (a multiple
of 64 keeps the head's matmul on fast tiles); the data are synthetic tokens, which cost the same
to train on as text.

`offload`: GPT sizes from GPT-2 XL up, each with ZeRO-2 and its optimizer offloaded to host
memory (ZeRO-Offload), bf16, activation checkpointing and micro-batch 1. The planner
(`engine/plan`) skips sizes whose states cannot fit the GPU or this host; the rest are launched
from the largest down until one trains. Its size is compared with the largest the planner fits
on the same GPU without offload.

Both need a CUDA device and report themselves unavailable without one.
"""

from __future__ import annotations

from typing import Any

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
MFU_GOAL = Goal("engine", ">=", 0.5)
BASELINE = "nanoGPT-style loop"
VARIANTS = {
    "eager, SDPA": ["trainer.compile=false"],
    "compiled, SDPA": ["trainer.compile=true"],
    "compiled, eager attention": ["trainer.compile=true", "model.attn_implementation=eager"],
    "compiled, SDPA, activation checkpointing": ["trainer.compile=true", "model.activation_checkpointing=true"],
    "compiled, SDPA, torch_autocast": ["trainer.compile=true", "bf16.enabled=false", "torch_autocast.enabled=true"],
}
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
    overrides = run_overrides(steps, 10, eval_batches=1, threads=settings.threads)
    measured: dict[str, list[Pair]] = {}
    failures: dict[str, str] = {}
    for name, changes in VARIANTS.items():
        label = name.replace(", ", "-").replace(" ", "-")
        try:
            sets = [*COMMON, *changes, *overrides]
            measured[name] = rounds("torch", CONFIG, sets, settings.rounds, RUNS / "gpu", label)
        except RuntimeError as error:
            # One variant's failure (a kernel, a compile error) should not cost the others' figures.
            failures[name] = str(error)
            print(f"  {name}: failed: {error}", flush=True)
    if not measured:
        raise RuntimeError("no variant trained: " + "; ".join(f"{name}: {why}" for name, why in failures.items()))
    config = load_config(CONFIG, [*COMMON, *overrides], world_size=1, hardware=detect_hardware(local_world_size=1))
    peak = device_peak_flops(torch.cuda.get_device_name(), "bf16")
    machine = next(iter(measured.values()))[0].machine
    family = get_family(config.model.family)
    flops_per_token = family.flops_per_item(family.architecture(config.model.fields), config.data.as_mapping())
    return speed_result(measured, failures, flops_per_token, peak, steps, machine)


def speed_result(
    measured: dict[str, list[Pair]],
    failures: dict[str, str],
    flops_per_token: int,
    peak: float | None,
    steps: int,
    machine: dict[str, Any],
) -> Result:
    """Rows and plot of the variants' paired trials (`measured`, by variant name); `failures` names
    the variants that did not train, and why."""

    def mfu_of(side: Side) -> float:
        return float("nan") if peak is None else mfu(flops_per_token, side.tokens_per_s, peak, world_size=1)

    rows: list[Row] = []
    series: dict[str, tuple[list[float], list[float]]] = {}
    for number, name in enumerate(VARIANTS):
        pairs = measured.get(name)
        if pairs is None:
            continue
        rows.append(
            compare(
                f"{name}: tokens/s",
                median([p.baseline.tokens_per_s for p in pairs]),
                median([p.engine.tokens_per_s for p in pairs]),
                ratio=median([p.ratio for p in pairs]),
            )
        )
        rows.append(
            compare(
                f"{name}: MFU",
                median([mfu_of(p.baseline) for p in pairs]),
                median([mfu_of(p.engine) for p in pairs]),
                MFU_GOAL,
                not_judged=None if peak is not None else "no peak FLOP/s known for this GPU",
            )
        )
        for side in ("engine", "baseline"):
            xs, ys = series.setdefault(BASELINE if side == "baseline" else side, ([], []))
            xs.append(number)
            ys.append(median([getattr(p, side).tokens_per_s for p in pairs]))
    trials = len(next(iter(measured.values())))
    return Result(
        name="gpu",
        title="GPT-2 124M on one GPU: tokens/s and MFU",
        baseline=BASELINE,
        method=(
            f"{CONFIG.relative_to(ROOT)} with {', '.join(COMMON)}; {trials} round(s) per variant, each a "
            f"fresh process in which the engine and the loop alternate window by window for {steps} steps "
            "(bench/paired.py), speed from the median 10-step window after the first (which holds compilation). "
            "MFU = 6N + attention FLOPs per token (the model family's count) x tokens/s / the GPU's dense bf16 "
            "peak. "
            "Variants, x axis of the plot: " + "; ".join(f"{i} {name}" for i, name in enumerate(VARIANTS)) + "."
        ),
        rows=rows,
        panels=[Panel(title="gpu: tokens/s by variant", xlabel="variant", ylabel="tokens/s", series=series)],
        machine=machine,
        failures=failures,
    )


def offload(settings: Settings) -> Result:
    _require_gpu()
    device_memory = torch.cuda.get_device_properties(0).total_memory
    host_memory = psutil.virtual_memory().total
    overrides = run_overrides(3, 1, eval_batches=1, threads=settings.threads)

    def sized(size: tuple[int, int, int], layout: list[str]) -> list[str]:
        layers, width, heads = size
        return [*OFFLOAD, *layout, f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"]

    def fits(sets: list[str]) -> bool:
        plan = plan_run(load_config(CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1)))
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
