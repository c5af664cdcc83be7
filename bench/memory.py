"""Benchmark 4: model-state bytes per rank under ZeRO-0/1/2/3 and offload, 2 ranks, against the
ZeRO paper's formulas (Rajbhandari et al. 2020, figure 1).

The formulas are those of mixed-precision Adam with Psi parameters on N ranks: 2 Psi bytes of 16-bit
parameters, 2 Psi of 16-bit gradients and K Psi = 12 Psi of fp32 optimizer states (master weights,
momentum, variance). Stage 1 divides the optimizer states by N, stage 2 the gradients too, stage 3
the parameters too; offload moves the same bytes to host memory. So the runs are bf16, where the
formulas apply as written. Each rank counts what it holds at the optimizer step of a logged step
(`engine/observability/memory.py`); the gap to the formula is DeepSpeed's padding and buffers, which
`python -m engine plan` accounts for byte by byte.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.machine import machine_facts
from bench.results import Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, launch_engine, run_overrides
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.plan.shapes import build_on_meta
from models import get_family
from models.module_state import count_parameters

CONFIG = ROOT / "configs" / "shakespeare_char.json"
RANKS = 2
STEPS = 2
# 65: the corpus's characters; a one-step warm-up, as the runs last STEPS steps.
COMMON = ["data.type=synthetic", "model.vocab_size=65", "bf16.enabled=true", "scheduler.params.warmup_num_steps=2"]
LAYOUTS = {
    "ZeRO-0": ["zero_optimization.stage=0"],
    "ZeRO-1": ["zero_optimization.stage=1"],
    "ZeRO-2": ["zero_optimization.stage=2"],
    "ZeRO-3": ["zero_optimization.stage=3"],
    "ZeRO-2 + optimizer offload": ["zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu"],
    "ZeRO-3 + parameter and optimizer offload": [
        "zero_optimization.stage=3",
        "zero_optimization.offload_optimizer.device=cpu",
        "zero_optimization.offload_param.device=cpu",
    ],
}
STATES = {"parameters": "parameter_bytes", "gradients": "gradient_bytes", "optimizer states": "optimizer_bytes"}


def zero_formula(stage: int, parameters: int, ranks: int) -> dict[str, float]:
    """Per-rank bytes of each model state by the paper's formula (K = 12)."""
    return {
        "parameters": 2 * parameters / (ranks if stage >= 3 else 1),
        "gradients": 2 * parameters / (ranks if stage >= 2 else 1),
        "optimizer states": 12 * parameters / (ranks if stage >= 1 else 1),
    }


def parameter_count(config_path: Path, sets: list[str]) -> int:
    """The model's parameters (a tied weight once), counted on the meta device without its memory."""
    config = load_config(config_path, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    model = build_on_meta(get_family(config.model.family), config.model.fields)
    return count_parameters(model)


def method(psi: int) -> str:
    return (
        f"{CONFIG.relative_to(ROOT)} in bf16 on synthetic tokens, {psi:,} parameters, {RANKS} ranks under the "
        f"`deepspeed` launcher, {STEPS} steps. Measured: bytes of distinct storages each rank holds at the "
        "optimizer step, averaged over the ranks. Formula: 2 Psi parameters, 2 Psi gradients and 12 Psi optimizer "
        "states, divided by the number of ranks from stage 3, 2 and 1 on. Offloaded bytes are counted where they "
        "live (host memory on a GPU machine). Where DeepSpeed differs from the formula: ZeRO-1 and 2 keep, at "
        "the step, the whole gradient of every parameter that overlaps their partition, so a parameter straddling "
        "two partitions has its full gradient on both ranks; under optimizer offload a rank's gradient is the "
        "fp32 one of its host master partition (4 Psi / N), at ZeRO-3 beside its bf16 partition; stage 3 pads "
        "each parameter to a multiple of the ranks and keeps parameters below stage3_param_persistence_threshold "
        "whole. "
        "`python -m engine plan` predicts every one of these figures to the byte (engine/plan/states.py). "
        "Layouts, x axis of the plot: " + "; ".join(f"{i} {name}" for i, name in enumerate(LAYOUTS)) + "."
    )


def run(settings: Settings) -> Result:
    psi = parameter_count(CONFIG, COMMON)
    overrides = run_overrides(STEPS, 1, eval_batches=1, threads=max(1, settings.threads // RANKS))
    rows: list[Row] = []
    formula_totals, measured_totals = [], []
    for name, layout in LAYOUTS.items():
        print(f"  {name}", flush=True)
        slug = name.lower().replace(" + ", "-").replace(" ", "-")
        records = launch_engine(CONFIG, [*COMMON, *layout, *overrides], RUNS / "memory" / slug, RANKS)
        ranks = records[-1]["ranks"]
        stage = int(layout[0].rsplit("=", 1)[1])
        expected = zero_formula(stage, psi, RANKS)
        for state, key in STATES.items():
            held = statistics.mean(rank[key] for rank in ranks)
            rows.append(compare(f"{name}: {state}", expected[state], held))
        formula_totals.append(sum(expected.values()))
        measured_totals.append(sum(statistics.mean(rank[key] for rank in ranks) for key in STATES.values()))
    positions = list(range(len(LAYOUTS)))
    return Result(
        name="memory",
        title="Model-state bytes per rank against the ZeRO formulas",
        baseline="ZeRO formula",
        method=method(psi),
        rows=rows,
        panels=[
            Panel(
                title="memory: model states per rank",
                xlabel="layout",
                ylabel="bytes",
                series={"ZeRO formula": (positions, formula_totals), "measured": (positions, measured_totals)},
            )
        ],
        machine=machine_facts(settings.threads),
    )
