"""`python -m bench.gpu_check [--budget S] [--out DIR]` (`make gpu-check`): one command that proves a GPU node.

GPU time is rare and short, so everything runs from one prepared command, never stops at the first
failure, and writes its summary after every check (a run cut short keeps what it measured):

1. the GPU tests (`pytest -m gpu`): every precision trained, saved, resumed and exported, fp16's
   loss scaler, a background save from device memory and a ZeRO-Offload run, each resumed against
   the uninterrupted run, and quiet steps that read nothing back from the GPU;
2. benchmark 5's eager and compiled rows for GPT-2 124M;
3. the same for the 1B Llama at sequence 4096;
4. one ZeRO-Offload run of the largest GPT the planner fits on this GPU and host.

Checks run in that order; one whose estimated time exceeds what is left of `--budget` is reported
as not run. The estimates (seconds on one H100, start-up included) are what a CPU test holds to the
10 minutes the node check is allowed: the GPU tests' is measured (199 s for 18 tests, 8 at a time,
FusedAdam and CPU Adam built on the way, on 2026-11-27); the benchmarks' are not yet, and are set
from their trials' parts (two model builds, two compilations, 40 steps a side). The benchmark rows
are stored as `python -m bench` stores them (bench/results.json, docs/benchmarks.md), with this
summary as the report's GPU section.

On a machine without a CUDA GPU it says so, writes a summary that says so, and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import gpu
from bench.machine import machine_facts
from bench.report import GPU_CHECK, headline, load_results, store_results, write_report
from bench.results import Result
from bench.settings import Settings
from bench.trials import ROOT, Pair

BUDGET_S = 600.0
SPEED_STEPS = 40  # four 10-step windows: the first (start-up, compilation) is dropped
TESTS = ROOT / "tests"


@dataclass
class Outcome:
    """What one check found: "passed", "failed", "goal not met" or "not run", its figures and why."""

    verdict: str
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0
    result: Result | None = None  # a benchmark's result, stored as `python -m bench` stores it

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "figures": self.figures, "detail": self.detail, "seconds": self.seconds}


@dataclass(frozen=True)
class Check:
    key: str  # what `--checks` names it by
    name: str
    estimate_s: float  # on one H100, start-up included
    run: Callable[[Path, float], Outcome]  # (where to write, seconds left of the budget)


def gpu_tests(out: Path, seconds_left: float) -> Outcome:
    """Every test marked `gpu`, eight at a time with pytest-xdist (the dev extra; each launches one rank
    of a tiny model, and the GPU has room for several), stopped where the budget ends."""
    report = out / "gpu-tests.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(TESTS), f"--junitxml={report}"]
    if _importable("xdist"):
        command += ["-n", str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=seconds_left)
    except subprocess.TimeoutExpired:
        return Outcome("failed", detail=f"stopped where the budget ended, after {seconds_left:.0f} s")
    (out / "gpu-tests.log").write_text(result.stdout + result.stderr)
    if not report.exists():
        return Outcome("failed", detail=(result.stdout + result.stderr)[-2000:])
    counts, failed = _junit(report)
    verdict = "passed" if result.returncode == 0 and counts["passed"] else "failed"
    return Outcome(verdict, {**counts, "failed tests": failed}, result.stdout.strip().splitlines()[-1])


def _junit(report: Path) -> tuple[dict[str, int], list[str]]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        key = {"failure": "failed", "error": "failed"}.get(outcome, outcome)
        counts[key] += 1
        if key == "failed":
            failed.append(case.get("name", "?"))
    return counts, failed


class SpeedRows:
    """Benchmark 5's eager and compiled rows, model by model, kept as one benchmark result."""

    VARIANTS = ("eager, SDPA", "compiled, SDPA")

    def __init__(self) -> None:
        self.measured: dict[str, dict[str, list[Pair]]] = {}
        self.failures: dict[str, str] = {}

    def of(self, subject: gpu.Subject) -> Callable[[Path, float], Outcome]:
        def run(out: Path, seconds_left: float) -> Outcome:
            measured, failures = gpu.measure(subject, list(self.VARIANTS), SPEED_STEPS, 1, threads=_threads())
            self.failures.update(failures)
            if not measured:
                return Outcome("failed", detail="; ".join(f"{name}: {why[-500:]}" for name, why in failures.items()))
            self.measured[subject.label] = measured
            result = gpu.speed_result(self.measured, self.failures, SPEED_STEPS)
            rows = [row for row in result.rows if row.quantity.startswith(subject.label + ",")]
            figures = {row.quantity: {"loop": row.baseline, "engine": row.engine, "ratio": row.ratio} for row in rows}
            missed = [row.quantity for row in rows if row.met is False]
            verdict = "failed" if failures else "goal not met" if missed else "passed"
            detail = "; ".join([*failures, *(f"goal not met: {quantity}" for quantity in missed)])
            return Outcome(verdict, figures, detail, result=result)

        return run


def offload(out: Path, seconds_left: float) -> Outcome:
    settings = Settings(rounds=1, steps=3, log_interval=1, quality_steps=1, quality_rounds=1, threads=_threads())
    try:
        result = gpu.offload(settings)
    except RuntimeError as error:
        return Outcome("failed", detail=str(error)[-2000:])
    row = result.rows[0]
    figures = {"parameters trained": row.engine, "largest without offload": row.baseline}
    return Outcome("passed", figures, result=result)


_SPEED = SpeedRows()
CHECKS = (
    Check("tests", "GPU tests (every precision with a resume, background save, offload)", 210, gpu_tests),
    Check("gpt2", "benchmark 5: GPT-2 124M, eager and compiled", 120, _SPEED.of(gpu.SUBJECTS[0])),
    Check("llama", "benchmark 5: Llama 1B at sequence 4096, eager and compiled", 160, _SPEED.of(gpu.SUBJECTS[1])),
    Check("offload", "ZeRO-Offload: the largest GPT the planner fits", 110, offload),
)


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def node_facts() -> dict[str, Any]:
    """The device and every version a reader needs to reproduce the summary."""
    facts = machine_facts(_threads())
    facts.update(
        {
            "cuda": torch.version.cuda,
            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
            "nvcc": _first_line(["nvcc", "--version"], last=True),
            "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "platform": platform.platform(),
        }
    )
    if torch.cuda.is_available():
        facts["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return facts


def _first_line(command: list[str], last: bool = False) -> str | None:
    if shutil.which(command[0]) is None:
        return None
    lines = subprocess.run(command, capture_output=True, text=True).stdout.strip().splitlines()
    return (lines[-1] if last else lines[0]).strip() if lines else None


def summary_markdown(
    facts: dict[str, Any], outcomes: dict[str, Outcome], budget: float, estimates: dict[str, float]
) -> str:
    """The node check as a markdown section: the device, the versions, each check's verdict and figures."""
    device = facts.get("gpu") or "no CUDA GPU"
    if facts.get("gpu_memory_gib"):
        device += f" ({facts['gpu_memory_gib']} GiB)"
    names = ("torch", "CUDA", "driver", "nvcc", "DeepSpeed", "transformers", "Python")
    versions = ", ".join(f"{name} {facts.get(name.lower())}" for name in names)
    lines = [
        f"Node check (`make gpu-check`, budget {budget:.0f} s) on {device}, {facts.get('date')}: {versions}, "
        f"TORCH_CUDA_ARCH_LIST={facts.get('TORCH_CUDA_ARCH_LIST')}, commit {facts.get('commit')}.",
        "",
        "| check | verdict | seconds (estimate) | figures |",
        "|---|---|---:|---|",
    ]
    for name, outcome in outcomes.items():
        figures = "; ".join(f"{key}: {_figure(value)}" for key, value in outcome.figures.items())
        detail = f" ({outcome.detail})" if outcome.detail else ""
        lines.append(
            f"| {name} | {outcome.verdict}{detail} | {outcome.seconds:.0f} ({estimates.get(name, 0):.0f}) | "
            f"{figures or '—'} |"
        )
    return "\n".join(lines) + "\n"


def _figure(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{key} {_figure(inner)}" for key, inner in value.items())
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def write_summary(
    out: Path,
    facts: dict[str, Any],
    outcomes: dict[str, Outcome],
    budget: float,
    checks: tuple[Check, ...] = (),
    keep: Path | None = None,
) -> None:
    """summary.md and summary.json in `out`; on a GPU also `keep`, the report's GPU section."""
    markdown = summary_markdown(facts, outcomes, budget, {check.name: check.estimate_s for check in checks})
    (out / "summary.md").write_text(markdown)
    summary = {"facts": facts, "budget_s": budget, "checks": {name: o.to_json() for name, o in outcomes.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if keep is not None and facts.get("gpu"):
        keep.write_text(json.dumps({**summary, "markdown": markdown}, indent=2) + "\n")


def run_checks(out: Path, budget: float, checks: tuple[Check, ...] = CHECKS, keep: Path | None = GPU_CHECK) -> int:
    """Run `checks` in order within `budget` seconds, the summary written after each (and kept as the
    report's GPU section in `keep`); 1 if any failed or did not fit the budget."""
    out.mkdir(parents=True, exist_ok=True)
    facts = node_facts()
    started = time.monotonic()
    outcomes = {check.name: Outcome("not run", detail="waiting") for check in checks}
    results, history = load_results()
    measured: dict[str, Result] = {}
    for check in checks:
        left = budget - (time.monotonic() - started)
        if check.estimate_s > left:
            outcomes[check.name] = Outcome("not run", detail=f"estimated {check.estimate_s:.0f} s, {left:.0f} s left")
        else:
            print(f"gpu-check: {check.name} (about {check.estimate_s:.0f} s)", flush=True)
            began = time.monotonic()
            try:
                outcome = check.run(out, left)
            except Exception as error:  # one check's crash must not cost the others' figures
                outcome = Outcome("failed", detail=f"{type(error).__name__}: {error}"[-2000:])
            outcome.seconds = time.monotonic() - began
            outcomes[check.name] = outcome
            print(f"gpu-check: {check.name}: {outcome.verdict} in {outcome.seconds:.0f} s", flush=True)
            if outcome.result is not None:
                measured[outcome.result.name] = outcome.result
                store_results({**results, **measured}, history)
        write_summary(out, facts, outcomes, budget, checks, keep)
    if measured:
        history += [headline(result) for result in measured.values()]
        store_results({**results, **measured}, history)
        write_report(list({**results, **measured}.values()), history)
    print((out / "summary.md").read_text())
    return 1 if any(outcome.verdict in ("failed", "not run") for outcome in outcomes.values()) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the checks may take (default 600)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check", help="where the summary goes")
    keys = [check.key for check in CHECKS]
    parser.add_argument(
        "--checks", nargs="+", choices=keys, default=keys, help="which checks, in this order (default: all, as listed)"
    )
    args = parser.parse_args(argv)
    checks = tuple(next(check for check in CHECKS if check.key == key) for key in args.checks)
    if not torch.cuda.is_available():
        args.out.mkdir(parents=True, exist_ok=True)
        outcomes = {"CUDA GPU": Outcome("not run", detail="no CUDA GPU is present on this machine: nothing to check")}
        write_summary(args.out, node_facts(), outcomes, args.budget)
        print(f"gpu-check: no CUDA GPU is present on this machine; nothing to check (summary in {args.out})")
        return 0
    return run_checks(args.out, args.budget, checks)


if __name__ == "__main__":
    sys.exit(main())
