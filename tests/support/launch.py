"""Launching the engine the way users do (the real `deepspeed` and `accelerate` launchers, real
processes) and reading back what a run wrote."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
# Generous: the first launch on a fresh machine builds DeepSpeed's C++ ops (shm comm ~80 s,
# cpu_adam ~90 s) before it trains.
LAUNCH_TIMEOUT_S = 900
# Drawing the plots costs a launch about 6 s on the 2-core CI machine (matplotlib, seven PNGs while
# the other ranks wait); the test of the plots asks for them, the other launches do without.
TEST_DEFAULTS = {"trainer.plots": False}


def run_to_end(
    command: list[str], env: dict[str, str] | None = None, timeout: float = LAUNCH_TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`subprocess.run` in the project root, capturing text, whose timeout (or an interrupt of the
    tests) ends the whole process group: a launcher's ranks too, which killing the launcher alone
    would leave training, holding their port and the CPU, after the test has failed."""
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except BaseException:
            _end_group(process)
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _end_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class Run:
    output_dir: Path
    records: list[dict]
    stdout: str = ""

    @property
    def losses(self) -> list[float]:
        return [record["loss"] for record in self.records]

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        return load_file(self.output_dir / "export" / "model.safetensors")


def launch(config: str, overrides: dict[str, object], output_dir: Path, nproc: int = 2) -> Run:
    """Train `config` with `nproc` processes under the deepspeed launcher; fail with its output."""
    return _launch(deepspeed_launcher(nproc), config, overrides, output_dir, {})


def launch_accelerate(
    config: str, overrides: dict[str, object], output_dir: Path, nproc: int = 2, config_file: Path | None = None
) -> Run:
    """Train `config` under `accelerate launch` with the spelling that really starts `nproc`
    processes in one world: on CPU, ACCELERATE_USE_CPU=1 with --multi_gpu (or a MULTI_GPU file)."""
    if config_file is not None:
        launcher = ["accelerate", "launch", "--config_file", str(config_file), "--main_process_port", str(free_port())]
    else:
        launcher = accelerate_launcher(nproc)
    return _launch(launcher, config, overrides, output_dir, accelerate_env())


def launch_script(launcher: str, config: str, overrides: dict[str, object], output_dir: Path, nproc: int = 2) -> Run:
    """Train `config` through `./launch.sh --launcher LAUNCHER --nproc N`, the README's front door;
    fail with its output. The run's `stdout` holds what the script printed on both streams (the
    launcher command it ran goes to stderr)."""
    options = ["--launcher", launcher, "--nproc", str(nproc), "--master-port", str(free_port())]
    sets = set_arguments({**overrides, "trainer.output_dir": output_dir})
    result = run_to_end(["./launch.sh", *options, config, *sets], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise AssertionError(f"launch.sh exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}")
    return read_run(output_dir, result.stdout + result.stderr)


def accelerate_launcher(nproc: int) -> list[str]:
    multi = ["--multi_gpu"] if nproc > 1 else []
    return ["accelerate", "launch", "--num_processes", str(nproc), *multi, "--main_process_port", str(free_port())]


def accelerate_env() -> dict[str, str]:
    return {} if torch.cuda.is_available() else {"ACCELERATE_USE_CPU": "1"}


def deepspeed_launcher(nproc: int) -> list[str]:
    return ["deepspeed", "--num_gpus", str(nproc), "--master_port", str(free_port())]


def run_launcher(
    launcher: list[str], config: str, overrides: dict, output_dir: Path, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """Run `launcher engine/main.py ...` to the end, whatever its exit code."""
    sets = set_arguments({**overrides, "trainer.output_dir": output_dir})
    command = [*launcher, "engine/main.py", "--deepspeed_config", config, *sets]
    return run_to_end(command, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def _launch(launcher: list[str], config: str, overrides: dict, output_dir: Path, env: dict[str, str]) -> Run:
    result = run_launcher(launcher, config, overrides, output_dir, env)
    if result.returncode != 0:
        raise AssertionError(
            f"{' '.join(result.args)} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
        )
    return read_run(output_dir, result.stdout)


def run_single(config: str, overrides: dict[str, object], output_dir: Path) -> subprocess.CompletedProcess:
    """One process, no launcher: `python engine/main.py ...`."""
    sets = set_arguments({**overrides, "trainer.output_dir": output_dir})
    return run_to_end([sys.executable, "engine/main.py", "--deepspeed_config", config, *sets])


def read_run(output_dir: Path, stdout: str = "") -> Run:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return Run(output_dir, [json.loads(line) for line in lines], stdout)


def set_arguments(overrides: dict[str, object]) -> list[str]:
    """`overrides` as the `--set` arguments of a command line, with the tests' defaults."""
    return [f"--set={key}={_text(value)}" for key, value in {**TEST_DEFAULTS, **overrides}.items()]


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


@dataclass(frozen=True)
class NodeResult:
    returncode: int
    output: str  # stdout and stderr together


def launch_nodes(
    launcher_options: list[str],
    config: str,
    overrides: dict[str, object],
    env: dict[str, str] | None = None,
    nodes: int = 2,
) -> list[NodeResult]:
    """One `launch.sh` for each of two simulated nodes on loopback (node 0 at 127.0.0.1 hosts the
    rendezvous), started together, as operators start the nodes of a job; returns when every node has ended."""
    port = free_port()
    sets = [
        item for key, value in {**TEST_DEFAULTS, **overrides}.items() for item in ("--set", f"{key}={_text(value)}")
    ]
    processes = [
        subprocess.Popen(
            ["./launch.sh", *launcher_options, "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
            + ["--master-port", str(port), config, *sets],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (1, 0)
    ][::-1]
    results = []
    try:
        for process in processes:
            output = process.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
            results.append(NodeResult(process.returncode, output))
    except BaseException:
        for process in processes:
            _end_group(process)
        raise
    return results
