"""A stand-in for the `accelerate launch` process whose command line a rank reads from /proc
(engine/launch/detect.py), so unit tests read a real /proc entry without launching anything."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.launch.detect import LAUNCHER_PID_ENV


@contextlib.contextmanager
def accelerate_launched(arguments: list[str], cwd: Path) -> Iterator[None]:
    """This process reads as launched by `accelerate launch ARGUMENTS` started in `cwd`."""
    command = [sys.executable, "-c", "import time; time.sleep(300)", "accelerate", "launch", *arguments]
    process = subprocess.Popen(command, cwd=cwd)
    try:
        _wait_for_command_line(process.pid, command)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(LAUNCHER_PID_ENV, str(process.pid))
            yield
    finally:
        process.kill()
        process.wait()


def _wait_for_command_line(pid: int, command: list[str]) -> None:
    """Popen can return while the kernel is still writing the new program's arguments (it wakes a
    vfork parent before it sets them up), when /proc shows an empty command line for a moment."""
    expected = "\0".join(command).encode() + b"\0"
    deadline = time.monotonic() + 10
    while (Path("/proc") / str(pid) / "cmdline").read_bytes() != expected:
        assert time.monotonic() < deadline, f"process {pid} never showed its command line"
        time.sleep(0.01)
