"""A rank that dies, freezes or raises ends the whole job quickly, with a message naming it.

Faults are injected with ENGINE_FAULT into real launches; each job runs with a 10 s
communication timeout and must be over, non-zero, well inside a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from engine.checkpoints.store import latest_tag
from engine.failures.faults import parse_fault
from engine.launch.signals import EXIT_PREEMPTED
from tests.support.launch import (
    LAUNCH_TIMEOUT_S,
    ROOT,
    accelerate_env,
    accelerate_launcher,
    deepspeed_launcher,
    launch_nodes,
    run_launcher,
    set_arguments,
)

GPT = "configs/tiny_gpt.json"
TIMEOUT_S = 10
# Start-up (imports, process group, first step) on a loaded 2-core machine, plus the timeout.
JOB_END_LIMIT_S = 60
FAULT_RUN = {"trainer.max_steps": 6, "trainer.comm_timeout_s": TIMEOUT_S, "trainer.export": "false"}


BAD_FAULT_SPECS = [
    ("explode,rank=1,step=3", "action 'explode' is not one of kill, hang, raise"),
    ("kill,rank=1", "needs integer rank=N and step=N"),
    ("kill,rank=one,step=3", "needs integer rank=N and step=N"),
    ("kill,rank=1,step=3,when=later", "'when=later' is not rank=N, step=N or at=POINT"),
    ("kill,rank=1,step=3,at=lunch", "at=lunch is not one of step, save"),
]


@pytest.mark.parametrize("text, expected", BAD_FAULT_SPECS)
def test_bad_fault_specs_are_refused_saying_what_is_wrong(text: str, expected: str):
    with pytest.raises(ValueError, match="ENGINE_FAULT") as refused:
        parse_fault(text)
    assert expected in str(refused.value)


def test_a_bad_fault_spec_is_refused_before_anything_starts(tmp_path: Path):
    """engine/main.py reads ENGINE_FAULT before anything starts: every spec above ends there with its
    message and exit code 2 (one is launched; they share the road out)."""
    text, expected = BAD_FAULT_SPECS[0]
    env = {**os.environ, "ENGINE_FAULT": text}
    result = subprocess.run(
        [sys.executable, "engine/main.py", "--deepspeed_config", GPT, f"--set=trainer.output_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "logs").exists()  # refused before any rank started its log


def run_with_fault(fault: str, output_dir: Path, launcher: str = "deepspeed") -> tuple[CompletedProcess, float]:
    if launcher == "deepspeed":
        command, env = deepspeed_launcher(2), {}
    else:
        command, env = accelerate_launcher(2), accelerate_env()
    start = time.monotonic()
    result = run_launcher(command, GPT, FAULT_RUN, output_dir, {**env, "ENGINE_FAULT": fault})
    return result, time.monotonic() - start


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["deepspeed", "accelerate"])
def test_a_killed_rank_ends_the_job_and_is_named(launcher: str, tmp_path: Path):
    result, elapsed = run_with_fault("kill,rank=1,step=3", tmp_path, launcher)
    assert result.returncode != 0 and elapsed < JOB_END_LIMIT_S, (elapsed, result.stderr[-3000:])
    assert "rank 1 (local rank 1 on" in result.stderr and "was killed by SIGKILL" in result.stderr
    assert "ENGINE_FAULT injects 'kill' at step 3" in (tmp_path / "logs" / "rank1.log").read_text()


@pytest.mark.launch
def test_a_frozen_rank_ends_the_job_within_the_timeout(tmp_path: Path):
    result, elapsed = run_with_fault("hang,rank=1,step=3", tmp_path)
    assert result.returncode != 0 and elapsed < JOB_END_LIMIT_S, (elapsed, result.stderr[-3000:])
    output = result.stdout + result.stderr
    assert f"rank 0: ending: rank 1 stopped answering (no heartbeat for {TIMEOUT_S}" in output


@pytest.mark.launch
def test_a_raising_rank_is_named_on_the_terminal_and_logs_per_rank(tmp_path: Path):
    result, elapsed = run_with_fault("raise,rank=1,step=2", tmp_path)
    assert result.returncode != 0 and elapsed < JOB_END_LIMIT_S, (elapsed, result.stderr[-3000:])
    # Rank 1 writes only to its file, except for the one line that says it failed.
    assert "rank 1 failed: InjectedFault: ENGINE_FAULT raised at step 2" in result.stderr
    rank1 = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Traceback" in rank1 and "InjectedFault" in rank1
    rank0 = (tmp_path / "logs" / "rank0.log").read_text()
    assert "step=1 loss=" in rank0 and "step=1 loss=" in result.stdout  # rank 0: file and terminal
    assert "step=1 loss=" not in rank1


@pytest.mark.launch
def test_a_rank_lost_on_another_node_ends_this_node_too(tmp_path: Path):
    """Two no-ssh "nodes"; node 1's only rank is killed. Node 0's launcher cannot see that
    process: its rank learns from the watchdog, ends, and names rank 1."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    start = time.monotonic()
    nodes = launch_nodes(
        ["--hostfile", str(hostfile), "--no-ssh"],
        GPT,
        {**FAULT_RUN, "trainer.output_dir": tmp_path / "run"},
        {"ENGINE_FAULT": "kill,rank=1,step=3"},
    )
    elapsed = time.monotonic() - start
    assert all(node.returncode != 0 for node in nodes), [node.output[-2000:] for node in nodes]
    assert elapsed < JOB_END_LIMIT_S + 20, elapsed  # two launchers start side by side on 2 cores
    assert "was killed by SIGKILL" in nodes[1].output
    assert "rank 0: ending: rank 1 stopped answering" in nodes[0].output


# A run far longer than any test: only a signal ends it.
ENDLESS_RUN = {"trainer.max_steps": 100000, "trainer.export": False}


def launch_and_signal(launcher: str, output_dir: Path, to_every_process: bool = False) -> tuple[int, str]:
    """`./launch.sh` with an endless run, sent SIGUSR1 once rank 0 has logged a step (or, with
    `to_every_process`, SIGTERM to the script, its launcher and the ranks at once, as SLURM's scancel
    and preemption do); returns its exit code and output once it has ended."""
    sets = set_arguments({**ENDLESS_RUN, "trainer.output_dir": output_dir})
    (output_dir / "tmp").mkdir(parents=True)
    process = subprocess.Popen(
        ["./launch.sh", "--launcher", launcher, "--nproc", "2", GPT, *sets],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(output_dir / "tmp")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step="):
                break
        if to_every_process:
            os.killpg(process.pid, signal.SIGTERM)
        else:
            process.send_signal(signal.SIGUSR1)
        lines.append(process.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
        return process.returncode, "".join(lines)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.launch
@pytest.mark.parametrize(
    "launcher, to_every_process",
    [
        # DeepSpeed's launch.py exits with the first failing rank's code: 75.
        ("deepspeed", False),
        # torchrun exits 1 whatever its workers' codes (ChildFailedError); launch.sh reads the ranks'.
        ("torchrun", False),
        # The deepspeed runner dies of the SIGTERM at once; launch.sh waits for the ranks to save.
        ("deepspeed", True),
    ],
    ids=["deepspeed-sigusr1", "torchrun-sigusr1", "deepspeed-sigterm-to-every-process"],
)
def test_a_signal_to_launch_sh_saves_and_exits_75(launcher: str, to_every_process: bool, tmp_path: Path):
    code, output = launch_and_signal(launcher, tmp_path, to_every_process)
    assert code == EXIT_PREEMPTED, output[-4000:]
    if not to_every_process:
        assert "launch.sh: SIGUSR1 passed to 2 process(es)" in output  # the ranks, not the launcher
    saved = latest_tag(tmp_path / "checkpoints")
    assert saved is not None and (tmp_path / "checkpoints" / "latest").read_text().strip() == saved
    assert f"saved step {int(saved.removeprefix('step'))} and stopped (exit code 75)" in output
    assert not list((tmp_path / "tmp").glob("engine_exits.*"))  # launch.sh's, removed as it ended
