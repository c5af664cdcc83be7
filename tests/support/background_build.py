"""DeepSpeed's async_io op, built in the background while the suite's first tests run.

Its first build on a 2-core machine costs about nine CPU-minutes (issue 41: 23 minutes of wall time
on a busy machine), and only the NVMe tests need it. Built at the lowest priority on one core from
the start of the session, it fills the time the launched tests leave a core idle (their ranks wait on
rendezvous, sockets and each other), instead of adding minutes in front of the first NVMe test. It
builds under the engine's own per-node lock (engine/launch/ops.py), so a test that needs the op
before it is done waits for it, as a rank of a real run waits for its node's build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.launch import ROOT

OP = "async_io"
_BUILD = (
    f"from engine.launch.ops import device_capabilities, preflight_ops; preflight_ops([{OP!r}], device_capabilities())"
)


def start_build(log: Path) -> subprocess.Popen | None:
    """Start building the op unless it is cached or cannot be built here (no libaio: the NVMe tests
    then fail with the pre-flight's message); the process, or None."""
    from deepspeed.accelerator import get_accelerator

    from engine.launch.ops import op_build_dir, op_problems

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or any(op_build_dir(builder.name).glob("*.so")) or op_problems([OP], []):
        return None
    env = {**os.environ, "MAX_JOBS": "1"}  # one compiler at a time: the other core stays the tests'
    with log.open("w") as out:
        return subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-c", _BUILD], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def stop_build(process: subprocess.Popen) -> None:
    """End a build the session no longer needs (a killed build leaves a lock the next one clears)."""
    if process.poll() is None:
        process.terminate()
        process.wait()
