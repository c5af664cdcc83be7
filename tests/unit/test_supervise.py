"""The supervisor's watch over the command that started the job (engine/failures/supervise.py), on a
chain of small stdlib processes shaped like a launch: the command the user typed, its launcher, the
real supervisor, and a rank that notes a SIGTERM and exits 75 as a rank that saved does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from engine.failures.supervise import job_top, parent_pid
from engine.launch.detect import LAUNCHER_PID_ENV, SUPERVISED_ENV, TOP_PID_ENV
from tests.support.launch import ROOT

# argv: ROLE OUT [LAUNCHER_WORDS...]. LAUNCHER_WORDS are the launcher's extra arguments:
# "deepspeed.launcher.launch" makes its command line DeepSpeed's per-node launcher's.
CHAIN = """
import json, os, signal, subprocess, sys, time
from pathlib import Path

role, out = sys.argv[1], Path(sys.argv[2])
if role == "command":
    subprocess.Popen([sys.executable, __file__, "launcher", str(out), *sys.argv[3:]])
elif role == "launcher":
    code = "import sys; from engine.failures.supervise import supervise; sys.exit(supervise(sys.argv[1], sys.argv[2:]))"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0"}
    supervisor = subprocess.Popen([sys.executable, "-c", code, __file__, "rank", str(out)], env=env)
    (out / "supervisor.exit").write_text(str(supervisor.wait()))
    sys.exit(0)
else:
    def saved_and_stopped(signum, frame):
        (out / "rank.sigterm").touch()
        sys.exit(75)
    signal.signal(signal.SIGTERM, saved_and_stopped)
    (out / "rank.env.partial").write_text(json.dumps(dict(os.environ)))
    (out / "rank.env.partial").rename(out / "rank.env")
while True:
    time.sleep(1)
"""
# Longer than two of the supervisor's checks.
QUIET_S = 2.5


def start_chain(tmp_path: Path, deepspeed_launcher: bool) -> tuple[psutil.Process, psutil.Process, list[int]]:
    """The chain, once its rank runs: the command, the launcher, and the launcher and top pids the
    supervisor gave the rank."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    words = ["deepspeed.launcher.launch"] if deepspeed_launcher else []
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", SUPERVISED_ENV)}
    command = subprocess.Popen([sys.executable, str(script), "command", str(tmp_path), *words], cwd=ROOT, env=env)
    wait_for(tmp_path / "rank.env", timeout=30)
    rank_env = json.loads((tmp_path / "rank.env").read_text())
    top = psutil.Process(command.pid)
    return top, top.children()[0], [int(rank_env[LAUNCHER_PID_ENV]), int(rank_env[TOP_PID_ENV])]


def end_chain(top: psutil.Process, launcher: psutil.Process) -> None:
    processes = [launcher, *launcher.children(recursive=True), top] if launcher.is_running() else [top]
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(processes, timeout=10)


def wait_for(path: Path, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)


def test_the_deepspeed_runner_ending_stops_the_ranks_as_a_sigterm_would(tmp_path: Path):
    """The `deepspeed` runner exits at once on a SIGTERM and passes nothing on: the rank gets the
    SIGTERM from its supervisor, and the launcher sees its exit status."""
    top, launcher, (launcher_pid, top_pid) = start_chain(tmp_path, deepspeed_launcher=True)
    try:
        assert (launcher_pid, top_pid) == (launcher.pid, top.pid)
        assert job_top(launcher.pid) == top.pid and parent_pid(launcher.pid) == top.pid
        top.send_signal(signal.SIGTERM)
        wait_for(tmp_path / "supervisor.exit")
        assert (tmp_path / "rank.sigterm").exists()
        assert (tmp_path / "supervisor.exit").read_text() == "75"
    finally:
        end_chain(top, launcher)


def test_a_launcher_that_dies_without_its_ranks_stops_them(tmp_path: Path):
    """torchrun, `accelerate launch` and torch.distributed.launch pass a SIGTERM on, but not a
    SIGKILL or a signal they do not handle."""
    top, launcher, (launcher_pid, top_pid) = start_chain(tmp_path, deepspeed_launcher=False)
    try:
        assert launcher_pid == top_pid == launcher.pid == job_top(launcher.pid)
        launcher.kill()
        wait_for(tmp_path / "rank.sigterm")
    finally:
        end_chain(top, launcher)


def test_what_started_another_launcher_may_end_without_stopping_the_job(tmp_path: Path):
    """Only DeepSpeed's per-node launcher answers for the process above it: a shell that started
    torchrun under nohup may exit."""
    top, launcher, _ = start_chain(tmp_path, deepspeed_launcher=False)
    try:
        top.kill()
        top.wait(10)
        time.sleep(QUIET_S)
        assert not (tmp_path / "rank.sigterm").exists()
        assert launcher.is_running()
    finally:
        end_chain(top, launcher)
