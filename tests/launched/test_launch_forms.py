"""Every launch form docs/launching.md gives, typed as users type it: each trains the tiny GPT on 2
CPU ranks, and a SIGTERM to the command the user typed (what a scheduler or a container runtime
sends) saves a checkpoint and ends every process of the job, and the run resumes from it under the
same form to the deepspeed launcher's uninterrupted losses and final weights, bit for bit.

One stopped launch and one resumed launch per form prove all three: the steps before the stop and
the steps after the resume are together the uninterrupted run's."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from engine.checkpoints.store import latest_tag, step_tag
from engine.launch.signals import EXIT_PREEMPTED, RANK_EXITS_ENV, recorded_exits
from tests.support.launch import (
    LAUNCH_TIMEOUT_S,
    ROOT,
    Run,
    accelerate_env,
    free_port,
    launch,
    read_run,
    set_arguments,
)

GPT = "configs/tiny_gpt.json"
# Dropout draws from every rank's generator each step: the resume is exact only if the RNG states are.
# One thread per rank under every launcher (torchrun sets OMP_NUM_THREADS=1, deepspeed does not), so
# every form reduces in the same order.
RUN = {"model.dropout": 0.1, "trainer.max_steps": 8, "trainer.threads_per_rank": 1}
STOP_STEP = 3
# Rank 0 sends SIGTERM to the command the user typed once step 3 is done, and waits for it to come
# back down (engine/failures/faults.py): whichever way it travels, the ranks stop after step 3.
SIGTERM_TO_COMMAND = {"ENGINE_FAULT": f"signal,rank=0,step={STOP_STEP},to=top"}
# The most a job's processes may outlive its command: DeepSpeed's launch.py SIGKILLs ranks 30 s after
# it sends them SIGTERM, and torchrun does the same; the saves here take well under a second.
JOB_END_S = 60
MAIN = ["engine/main.py", "--deepspeed_config", GPT]
# Each form: one command per node ({port}: a free port; {accelerate_config}: the file the engine's
# `accelerate-config` writes). The two-node form runs both nodes on loopback, one process each.
FORMS = {
    "deepspeed": [
        ["deepspeed", "--num_gpus=2", "--master_port={port}"]
        + ["engine/main.py", "--deepspeed", f"--deepspeed_config={GPT}"]
    ],
    "torchrun-standalone": [["torchrun", "--standalone", "--nproc_per_node=2", *MAIN]],
    "torchrun-two-nodes": [
        ["torchrun", "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1", "--master_addr=127.0.0.1"]
        + ["--master_port={port}", *MAIN]
        for rank in (0, 1)
    ],
    "torch-distributed-launch": [
        [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0"]
        + ["--master_addr=127.0.0.1", "--master_port={port}", *MAIN]
    ],
    "accelerate-config-file": [
        ["accelerate", "launch", "--config_file", "{accelerate_config}", "--main_process_port={port}", *MAIN]
    ],
}
# How each node's command ends on the SIGTERM, its authors' choice (docs/launching.md): the deepspeed
# runner dies of it before the ranks save; the others wait for their workers and exit 1.
STOPPED_EXITS = {
    "deepspeed": [-15],
    "torchrun-standalone": [1],
    "torchrun-two-nodes": [1, 1],
    "torch-distributed-launch": [1],
    "accelerate-config-file": [1],
}


@dataclass(frozen=True)
class Job:
    returncodes: list[int]  # each node's command
    output: str  # every node's stdout and stderr
    rank_exits: dict[int, int]  # the exit code each rank recorded


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch(GPT, RUN, tmp_path_factory.mktemp("uninterrupted") / "run")


@pytest.fixture(scope="module")
def accelerate_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `accelerate config` leaves for `accelerate launch`, written from the JSON config."""
    path = tmp_path_factory.mktemp("accelerate") / "accelerate_config.yaml"
    command = [sys.executable, "-m", "engine", "accelerate-config", GPT, "--num-processes", "2", "--output", str(path)]
    written = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    return path


def run_job(form: str, overrides: dict, env: dict[str, str], accelerate_config: Path, directory: Path) -> Job:
    """Start each node's command of `form` together and wait for them; then wait (at most JOB_END_S)
    for every process of the job, found by the ENGINE_RANK_EXITS every one of them inherits, and
    fail if any is left, after ending it."""
    directory.mkdir(parents=True)
    exits = directory / "rank_exits"
    exits.mkdir()
    port = free_port()
    arguments = set_arguments(overrides)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", RANK_EXITS_ENV: str(exits), **env}
    if form.startswith("accelerate"):
        env.update(accelerate_env())
    logs = [directory / f"node{node}.log" for node in range(len(FORMS[form]))]
    processes = []
    try:
        for words, log in zip(FORMS[form], logs, strict=True):
            command = [word.format(port=port, accelerate_config=accelerate_config) for word in words] + arguments
            with log.open("w") as file:
                processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=file, stderr=subprocess.STDOUT))
        returncodes = [process.wait(timeout=LAUNCH_TIMEOUT_S) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        _, left = psutil.wait_procs(job_processes(exits), timeout=JOB_END_S)
        for process in left:
            process.kill()
    output = "\n".join(log.read_text() for log in logs)
    assert not left, f"processes of the job outlived its command by {JOB_END_S} s: {left}\n{output[-4000:]}"
    return Job(returncodes, output, recorded_exits(exits))


def job_processes(exits: Path) -> list[psutil.Process]:
    """Every process whose environment names `exits`: the launchers under the command, the
    supervisors, the ranks and what the ranks started."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(RANK_EXITS_ENV) == str(exits):
                found.append(process)
        except psutil.Error:
            continue
    return found


@pytest.mark.launch
@pytest.mark.parametrize("form", list(FORMS))
def test_a_sigterm_to_the_command_saves_and_the_run_resumes_as_uninterrupted(
    form: str, uninterrupted: Run, accelerate_config: Path, tmp_path: Path
):
    output_dir = tmp_path / "run"
    overrides = {**RUN, "trainer.output_dir": output_dir}
    stopped = run_job(form, overrides, SIGTERM_TO_COMMAND, accelerate_config, tmp_path / "stopped")
    assert stopped.returncodes == STOPPED_EXITS[form], stopped.output[-4000:]
    assert stopped.rank_exits and set(stopped.rank_exits.values()) == {EXIT_PREEMPTED}, stopped.output[-4000:]
    assert latest_tag(output_dir / "checkpoints") == step_tag(STOP_STEP)
    assert f"saved step {STOP_STEP} and stopped (exit code 75)" in (output_dir / "logs" / "rank0.log").read_text()
    if form == "deepspeed":
        assert "the command that started this job" in stopped.output, stopped.output[-4000:]

    resumed = run_job(form, {**overrides, "trainer.resume": True}, {}, accelerate_config, tmp_path / "resumed")
    assert resumed.returncodes == [0] * len(FORMS[form]), resumed.output[-4000:]
    run = read_run(output_dir)
    assert [record["step"] for record in run.records] == list(range(1, RUN["trainer.max_steps"] + 1))
    assert run.losses == uninterrupted.losses
    final, expected = run.exported_state_dict(), uninterrupted.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name
