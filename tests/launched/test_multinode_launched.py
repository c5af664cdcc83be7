"""Multi-node launches on one machine: DeepSpeed hostfiles and launch.sh options checked before
launch, two-node runs on loopback through every launcher route, and the ssh pre-flight."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.compare import CLIPPED_WEIGHT_TOLERANCE, LOSS_TOLERANCE, assert_weights_match, max_loss_difference
from tests.support.launch import ROOT, free_port, launch_nodes, read_run, run_to_end
from tests.support.multinode import hostfile
from tests.support.reference import reference_run
from tests.support.sshd import Sshd, loopback_sshd, sshd_available

GPT = "configs/tiny_gpt.json"


def test_validate_checks_the_config_against_the_hostfile_world(tmp_path: Path):
    path = hostfile(tmp_path, "worker-1 slots=2\nworker-2 slots=1\n")
    command = [sys.executable, "-m", "engine", "validate", GPT, "--hostfile", str(path)]
    result = subprocess.run(
        [*command, "--set=parallel.pipeline_parallel_size=2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        "parallel: world size 3 is not divisible by tensor_parallel_size x pipeline_parallel_size = 2" in result.stderr
    )
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "valid for 3 rank(s)" in result.stdout


def test_launch_script_refuses_a_master_port_in_use(tmp_path: Path):
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = ["./launch.sh", "--hostfile", str(path), "--master-port", str(port), GPT]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"master port {port} is in use on this node" in result.stderr


@pytest.mark.parametrize(
    "options, expected",
    [
        (["--hostfile", "{hostfile}"], "several nodes need --master-port (every node must agree on it)"),
        (
            ["--hostfile", "{hostfile}", "--no-ssh", "--master-port", "{port}"],
            "--no-ssh needs --node-rank and --master-addr",
        ),
        (
            ["--launcher", "accelerate", "--hostfile", "{hostfile}", "--master-port", "{port}"],
            "--hostfile is for the deepspeed launcher",
        ),
        (["--num-nodes", "2", "--master-port", "{port}"], "several nodes under the deepspeed launcher need --hostfile"),
        (
            ["--launcher", "torchrun", "--num-nodes", "2", "--master-port", "{port}"],
            "--num-nodes needs --node-rank and --master-addr",
        ),
        (["--launcher", "mpirun"], "--launcher must be deepspeed, accelerate or torchrun, not 'mpirun'"),
        (["--nodes", "2"], "unknown option --nodes"),
    ],
)
def test_launch_script_refuses_incomplete_multi_node_options(tmp_path: Path, options: list[str], expected: str):
    path = hostfile(tmp_path, "127.0.0.1 slots=1\nlocalhost slots=1\n")
    command = ["./launch.sh", *(option.format(hostfile=path, port=free_port()) for option in options), GPT]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and expected in result.stderr, result.stderr


@pytest.mark.launch
@pytest.mark.parametrize(
    "launcher, stage",
    [("deepspeed", 2), ("accelerate", 0), ("torchrun", 1)],
    ids=["deepspeed-no-ssh-zero2", "accelerate-ddp", "torchrun-zero1"],
)
def test_two_nodes_train_like_one_process(launcher: str, stage: int, tmp_path: Path):
    """Two "nodes" of one process each on loopback, one launch.sh per node: the deepspeed launcher's
    no-ssh route with hosts 127.0.0.1 and localhost, `accelerate launch --num_machines 2` (static
    rendezvous: the c10d one clashes on the port when both nodes start at once) and torchrun."""
    if launcher == "deepspeed":
        path = hostfile(tmp_path, "127.0.0.1 slots=1\nlocalhost slots=1\n")
        options = ["--hostfile", str(path), "--no-ssh"]
    else:
        options = ["--launcher", launcher, "--nproc", "1", "--num-nodes", "2"]
    output_dir = tmp_path / "run"  # one output directory: it is shared storage
    nodes = launch_nodes(options, GPT, {"zero_optimization.stage": stage, "trainer.output_dir": output_dir})
    assert all(node.returncode == 0 for node in nodes), nodes[0].output[-3000:] + nodes[1].output[-3000:]
    outputs = [node.output for node in nodes]
    run = read_run(output_dir)
    expected_command = {
        "deepspeed": "--no_ssh --node_rank 0 --master_addr 127.0.0.1",
        "accelerate": "--num_machines 2 --machine_rank 0 --main_process_ip 127.0.0.1",
        "torchrun": "--nnodes 2 --node_rank 0 --master_addr 127.0.0.1",
    }[launcher]
    assert expected_command in outputs[0]
    backend = "accelerate" if launcher == "accelerate" else "deepspeed"
    assert f"on 2 rank(s), {backend} backend" in outputs[0]
    reference = reference_run(GPT, {"zero_optimization.stage": stage}, world_size=2)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory):
    with loopback_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


needs_sshd = pytest.mark.skipif(sshd_available() is not None, reason=str(sshd_available()))


@needs_sshd
def test_ssh_preflight_names_the_host_that_does_not_answer(sshd: Sshd, tmp_path: Path):
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # the test sshd is not on .3
    command = ["./launch.sh", "--hostfile", str(path), "--ssh-port", str(sshd.port), "--master-port", str(free_port())]
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": sshd.client_options}
    result = subprocess.run([*command, GPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "ssh pre-flight failed" in result.stderr and "host '127.0.0.3' does not answer" in result.stderr
    assert "127.0.0.1'" not in result.stderr


@needs_sshd
@pytest.mark.launch
def test_pdsh_route_trains_like_one_process_and_carries_the_environment(sshd: Sshd, tmp_path: Path):
    """deepspeed starts both "nodes" through pdsh over the test sshd; ranks begin in a fresh ssh
    session, so OMP_NUM_THREADS=3 reaches them only through the launch environment file."""
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    output_dir = tmp_path / "run"
    command = ["./launch.sh", "--hostfile", str(path), "--ssh-port", str(sshd.port), "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), GPT, "--set", "zero_optimization.stage=2"]
    command += ["--set", f"trainer.output_dir={output_dir}", "--set", "trainer.plots=false"]
    env = {**os.environ, "PDSH_SSH_ARGS_APPEND": sshd.client_options, "OMP_NUM_THREADS": "3", "PYTHONUNBUFFERED": "1"}
    result = run_to_end(command, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every rank gets:" in result.stderr and "OMP_NUM_THREADS" in result.stderr
    assert "127.0.0.2: " in result.stdout + result.stderr  # pdsh prefixes each node's lines
    resolved = json.loads((output_dir / "resolved_config.json").read_text())
    assert resolved["trainer"]["threads_per_rank"] == 3
    run = read_run(output_dir)
    reference = reference_run(GPT, {"zero_optimization.stage": 2}, world_size=2)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)
