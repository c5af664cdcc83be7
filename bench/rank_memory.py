"""Each rank's peak resident memory while a launch runs, read from /proc: the watcher that the data
and sequence benchmarks launch through.

The peak is VmHWM, the kernel's high-water mark of a process's resident set, read every POLL_S
seconds; it only grows, so only growth in a rank's last POLL_S is missed. It counts the pages of a
memory-mapped token file that a rank has touched, so a rank that read a whole corpus would show it.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil

from bench.trials import ROOT

POLL_S = 0.1
MIB = 1 << 20


def watched_launch(command: list[str], run_dir: Path, ranks: int) -> dict[int, int]:
    """Run `command`, a launch of `ranks` ranks, its output in `run_dir`/trial.log, and return each
    rank's peak resident memory; raise with the log's tail where it fails or a rank went unread."""
    log = run_dir / "trial.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        peaks = watch_ranks(process)
    if process.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise RuntimeError(f"{' '.join(command[:4])} ... exited {process.returncode}; log {log}:\n{tail}")
    if sorted(peaks) != list(range(ranks)):
        raise RuntimeError(f"{run_dir}: read the peak RSS of ranks {sorted(peaks)} of {ranks} (is /proc there?)")
    return peaks


def watch_ranks(process: subprocess.Popen) -> dict[int, int]:
    """Each rank's peak RSS while `process` runs, in bytes: the largest VmHWM among the processes
    that run engine/main.py with that RANK (the rank and its small supervisor,
    engine/failures/supervise.py), read every POLL_S seconds."""
    launcher, known, peaks = psutil.Process(process.pid), {}, {}
    while process.poll() is None:
        try:
            children = launcher.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            if child.pid not in known:
                # Not cached when None: a rank is seen between fork and exec with its parent's identity.
                rank = _rank_of(child)
                if rank is None:
                    continue
                known[child.pid] = rank
            high_water = _high_water(child.pid)
            if high_water is not None:
                peaks[known[child.pid]] = max(peaks.get(known[child.pid], 0), high_water)
        time.sleep(POLL_S)
    return peaks


def _rank_of(process: psutil.Process) -> int | None:
    try:
        if not any(arg.endswith("engine/main.py") for arg in process.cmdline()):
            return None
        rank = process.environ().get("RANK")
    except psutil.Error:
        return None
    return None if rank is None else int(rank)


def _high_water(pid: int) -> int | None:
    """The process's peak resident set (VmHWM), None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
