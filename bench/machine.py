"""Facts about the machine a result was measured on, stored with the result."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch


def machine_facts(threads: int) -> dict[str, Any]:
    """CPU model and cores, GPU, library versions and the UTC time: what a reader needs to judge
    whether a figure applies to their machine."""
    return {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "threads": threads,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": measured_commit(),
    }


def measured_commit() -> str | None:
    """The commit whose code was measured, marked "+changes" when the code that runs (the engine,
    models, data, bench; not the stored results) differs from it."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        result = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        return result.stdout.strip() if result.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if commit is None:
        return None
    code = ["engine", "models", "data", "parallelism", "bench", ":!bench/results.json", "configs"]
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *code)
    return commit + ("+changes" if changed else "")


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None
