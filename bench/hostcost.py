"""Benchmark 8: what a step costs the host, layout by layout: host reads of the device, aten
operations and graph breaks, the engine beside a minimal PyTorch loop.

A step that reads the device makes the host wait for the GPU, and a GPU whose host waits idles
between kernels: on an H200 that was the engine's fixed 18-20 ms a step over a compiled loop
(docs/benchmarks.md, gpu). The reads, the operations and the graph breaks happen on the CPU too, so
they are counted here (bench/host_syncs.py) on GPT-2 124M's 148 tensors at width 64, with
`torch_adam` false: DeepSpeed's FusedAdam and its wrappers, what a GPU ran when these figures were
measured (torch's fused AdamW has been the default since; re-measuring on it is still to do). Layouts of more than
one data-parallel rank run on 2 ranks, so that DeepSpeed's ZeRO wrappers and DDP/FSDP2 are the ones
counted; the loop runs in the one-rank layouts. Host time per step is the median of the uncounted
quiet steps (on a CPU, compute is host time too).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.host_syncs import WARMUP_STEPS
from bench.machine import machine_facts
from bench.optimizer_step import SMALL_GPT2
from bench.results import Goal, Panel, Result, Row, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, run_logged
from engine.parallel.process_group import free_port

CONFIG = ROOT / "configs" / "gpt2_124m.json"
STEPS, LOG_INTERVAL = 14, 7
COMMON = [
    *SMALL_GPT2,
    "train_micro_batch_size_per_gpu=1",
    "gradient_accumulation_steps=1",
    "train_batch_size=auto",
    "scheduler.params.warmup_num_steps=2",
    "optimizer.params.torch_adam=false",
    f"trainer.max_steps={STEPS}",
    f"trainer.log_interval={LOG_INTERVAL}",
    "trainer.eval_interval=0",
    "trainer.eval_batches=1",
    "trainer.save_interval=0",
    "trainer.threads_per_rank=1",
    "trainer.export=false",
    "trainer.plots=false",
    "trainer.progress_bar=false",
    "trainer.sample_tokens=0",
]


@dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]
    processes: int = 1
    loop: bool = False  # count the minimal loop beside it (one-rank layouts)
    compiled: bool = False
    # A route the engine takes unless told otherwise: its reads have the goal and count in the
    # headline. The others are there to show what they cost (a policy that must read, bf16 as
    # written at ZeRO-0, which "auto" no longer picks).
    default: bool = True


LAYOUTS = (
    Layout("ZeRO-0 fp32", ("zero_optimization.stage=0",), loop=True),
    Layout("ZeRO-0 torch_autocast", ("zero_optimization.stage=0", "torch_autocast.enabled=true"), loop=True),
    Layout("ZeRO-2 bf16, one rank", ("zero_optimization.stage=2", "bf16.enabled=true")),
    Layout(
        "ZeRO-0 bf16, fast path off",
        ("zero_optimization.stage=0", "bf16.enabled=true", "trainer.single_rank_fast_path=false"),
        default=False,
    ),
    Layout("ZeRO-1 fp32", ("zero_optimization.stage=1",), processes=2),
    Layout("ZeRO-2 bf16", ("zero_optimization.stage=2", "bf16.enabled=true"), processes=2),
    Layout("ZeRO-3 fp32", ("zero_optimization.stage=3",), processes=2),
    Layout(
        "pipeline 2 stages",
        ("zero_optimization.stage=1", "parallel.pipeline_parallel_size=2", "gradient_accumulation_steps=2"),
        processes=2,
    ),
    Layout("accelerate DDP", ("trainer.backend=accelerate", "zero_optimization.stage=0"), processes=2),
    Layout("accelerate FSDP2", ("trainer.backend=accelerate", "zero_optimization.stage=3"), processes=2),
    Layout("ZeRO-0 fp32 compiled", ("zero_optimization.stage=0", "trainer.compile=true"), loop=True, compiled=True),
    Layout(
        "accelerate DDP compiled",
        ("trainer.backend=accelerate", "zero_optimization.stage=0", "trainer.compile=true"),
        processes=2,
        compiled=True,
    ),
    # The cost of the one policy that reads the device at every step, beside the same run under "stop".
    Layout(
        "ZeRO-1 fp32 one rank, nonfinite stop",
        ("zero_optimization.stage=1", "trainer.single_rank_fast_path=false"),
        loop=True,
    ),
    Layout(
        "ZeRO-1 fp32 one rank, nonfinite skip",
        ("zero_optimization.stage=1", "trainer.nonfinite=skip"),
        loop=True,
        default=False,
    ),
)


def count(layout: Layout, run_dir: Path) -> list[dict]:
    """Each rank's counts for `layout`."""
    out = run_dir / "counts-{rank}.json"
    module = ["-m", "bench.host_syncs", "--config", str(CONFIG), "--out", str(out)] + (
        ["--loop"] if layout.loop else []
    )
    launcher = []
    if layout.processes > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(layout.processes)]
        launcher += ["--master_port", str(free_port())]
    run_logged([sys.executable, *launcher, *module], [*COMMON, *layout.overrides], run_dir)
    return [json.loads(Path(str(out).format(rank=rank)).read_text()) for rank in range(layout.processes)]


def reads_row(quantity: str, loop: float, reads: float, judged: bool = True) -> Row:
    """Host reads per step against the loop's, their ratio taken over at least one read (the loop's
    are 0 once transformers' mask stops reading, docs/design/models.md)."""
    return compare(quantity, loop, reads, Goal("engine", "<=", 0) if judged else None, ratio=reads / max(loop, 1.0))


@dataclass(frozen=True)
class Counted:
    """One layout's counts on the rank that reads the device most: the engine's, the loop's beside it
    (one-rank layouts), and the graph breaks of a compiled run (the most of any rank; 0 if not compiled)."""

    index: int  # the layout's place in LAYOUTS: the plots' x and the row order
    layout: Layout
    engine: dict
    loop: dict | None
    graph_breaks: int


def count_layouts() -> tuple[list[Counted], dict[str, str]]:
    """Every layout counted and printed, in LAYOUTS order, and the error of each that failed."""
    counted, failures = [], {}
    for index, layout in enumerate(LAYOUTS):
        try:
            ranks = count(layout, RUNS / "hostcost" / f"layout-{index}")
        except RuntimeError as error:
            failures[layout.name] = str(error)
            continue
        # The rank that reads the device most, and its operations.
        worst = max(ranks, key=lambda rank: rank["engine"]["syncs_per_step"])
        engine = worst["engine"]
        kinds = ", ".join(f"{kind} {value:g}" for kind, value in sorted(engine["syncs_by_kind"].items())) or "none"
        print(
            f"  {layout.name}: syncs/step {engine['syncs_per_step']:g} ({kinds}), aten ops/step "
            f"{engine['operations_per_step']:.0f}, ms/step {1e3 * engine['seconds_per_step']:.2f}"
            + (f", graph breaks {worst['graph_breaks']}" if layout.compiled else ""),
            flush=True,
        )
        breaks = max(rank["graph_breaks"] for rank in ranks) if layout.compiled else 0
        counted.append(Counted(index, layout, engine, worst.get("loop"), breaks))
    return counted, failures


def layout_rows(counted: list[Counted]) -> list[Row]:
    """Each layout's reads against the loop's in the same layout, or else the most the loop read in
    any layout counted so far; beside the loop, its ms and aten operations per step too."""
    rows, loop_syncs = [], 0.0
    for layout in counted:
        engine, loop, name = layout.engine, layout.loop, layout.layout.name
        if loop is not None:
            loop_syncs = max(loop_syncs, loop["syncs_per_step"])
        reads = loop_syncs if loop is None else loop["syncs_per_step"]
        rows.append(
            reads_row(
                f"{name}: host reads of the device per step", reads, engine["syncs_per_step"], layout.layout.default
            )
        )
        if loop is not None:
            rows.append(
                compare(f"{name}: ms per step", 1e3 * loop["seconds_per_step"], 1e3 * engine["seconds_per_step"])
            )
            rows.append(
                compare(f"{name}: aten ops per step", loop["operations_per_step"], engine["operations_per_step"])
            )
    return rows


def headline_rows(counted: list[Counted]) -> list[Row]:
    """The goals' rows, printed in one line: the engine's most reads in a default layout against the
    loop's most in any, graph breaks, and the first layout's aten operations against the loop's."""
    engine_syncs = max([0.0, *(layout.engine["syncs_per_step"] for layout in counted if layout.layout.default)])
    loop_syncs = max([0.0, *(layout.loop["syncs_per_step"] for layout in counted if layout.loop is not None)])
    breaks = sum(layout.graph_breaks for layout in counted)
    first = next((layout for layout in counted if layout.index == 0 and layout.loop is not None), None)
    ops_ratio = None if first is None else first.engine["operations_per_step"] / first.loop["operations_per_step"]
    rows = [
        reads_row("host reads of the device per quiet step, most of any layout", loop_syncs, engine_syncs),
        compare("graph breaks in the compiled steps", 0.0, breaks, Goal("engine", "<=", 0), ratio=float(breaks)),
    ]
    if ops_ratio is not None:
        # The goal's row; the operations themselves are in the layout's rows below.
        rows.append(compare(f"{LAYOUTS[0].name}: aten ops per step, ratio", 1.0, ops_ratio, Goal("ratio", "<=", 1.1)))
    ratio_text = "n/a" if ops_ratio is None else f"{ops_ratio:.3f}"
    print(
        f"hostcost: engine syncs/step {engine_syncs:g} (loop {loop_syncs:g}), aten ops ratio {ratio_text}, "
        f"graph breaks {breaks}",
        flush=True,
    )
    return rows


def run(settings: Settings) -> Result:
    counted, failures = count_layouts()
    return Result(
        name="hostcost",
        title="Host cost of a step: device reads, aten operations and graph breaks",
        baseline="minimal PyTorch loop",
        method=METHOD,
        rows=headline_rows(counted) + layout_rows(counted),
        panels=panels(counted),
        machine=machine_facts(1),
        failures=failures,
    )


def panels(counted: list[Counted]) -> list[Panel]:
    """Reads per step of the engine and of the loop, and the engine's ms per step, by layout."""
    looped = [layout for layout in counted if layout.loop is not None]
    reads = {
        "engine": ([layout.index for layout in counted], [layout.engine["syncs_per_step"] for layout in counted]),
        "loop": ([layout.index for layout in looped], [layout.loop["syncs_per_step"] for layout in looped]),
    }
    milliseconds = {
        "engine": (
            [layout.index for layout in counted],
            [1e3 * layout.engine["seconds_per_step"] for layout in counted],
        )
    }
    return [
        Panel(
            title="hostcost: host reads of the device per quiet step, by layout",
            xlabel="layout (row order)",
            ylabel="reads per step",
            series=reads,
        ),
        Panel(
            title="hostcost: ms per quiet step, by layout (a CPU: compute is host time)",
            xlabel="layout (row order)",
            ylabel="ms",
            series=milliseconds,
        ),
    ]


METHOD = (
    f"{CONFIG.relative_to(ROOT)} with {', '.join(COMMON)}: GPT-2 124M's 148 tensors at width 64. Per layout, "
    f"one run of {STEPS} steps (2 ranks where the layout has more than one data-parallel rank or stage); the "
    f"steps after the first {WARMUP_STEPS} that neither log, evaluate nor save are alternately counted "
    "(bench/host_syncs.py: scalar reads, tolist/cpu/numpy, synchronize, aten operations) and timed. The "
    "minimal loop (bench/baseline.py) runs the same config in the same process after the engine, in the "
    "one-rank layouts. Graph breaks are dynamo's count over the whole compiled run (the counted steps of "
    "a compiled run dispatch eagerly under the counter, so their operations are not the compiled "
    "graph's). Rows of reads compare with the loop's reads in the same layout (elsewhere its most in any "
    "layout), their ratio taken over at least one read; each layout's ms per step is in the printed "
    "lines and the second plot, and beside the loop's in the one-rank layouts. Rows without a goal "
    "are routes the engine takes only when told to: bf16 as written at ZeRO-0 (DeepSpeed's wrapper "
    "reads every gradient) "
    "and the nonfinite-skip policy, which reads the device every step (its cost: its ms against the "
    "row before it). "
    "DeepSpeed's FusedAdam on the CPU is one C++ call outside the dispatcher, as torch's fused AdamW "
    "is one operation per parameter group in the loop."
)
