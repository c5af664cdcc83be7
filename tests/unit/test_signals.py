"""launch.sh's signal handling (engine/launch/signals.py): exit records, the job's exit code, and
signals passed to the ranks of a real process tree and to nothing else."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from engine.launch.detect import SUPERVISED_ENV
from engine.launch.signals import (
    EXIT_PREEMPTED,
    RANK_EXITS_ENV,
    forward,
    job_exit_code,
    main,
    record_rank_exit,
    recorded_exits,
    runs_engine_main,
    stray_ranks,
)

# One process of a test tree: it notes each SIGUSR1 in OUT/NAME.signalled, then starts the rest of
# the chain below it (a name ending in "+supervised" with ENGINE_SUPERVISED=1, as the supervisor starts
# a rank; the others inherit their parent's environment, as a rank's data-loader workers do) and sleeps.
NODE = """
import os, signal, subprocess, sys, time
from pathlib import Path

out, name, rest = Path(sys.argv[1]), sys.argv[2].removesuffix("+supervised"), sys.argv[3:]
signal.signal(signal.SIGUSR1, lambda signum, frame: (out / f"{name}.signalled").touch())
if rest:
    env = {**os.environ, "ENGINE_SUPERVISED": "1"} if rest[0].endswith("+supervised") else None
    subprocess.Popen([sys.executable, __file__, str(out), *rest], env=env)
(out / f"{name}.ready").touch()
while True:
    time.sleep(1)
"""


@contextlib.contextmanager
def process_chain(tmp_path: Path, *names: str, env: dict[str, str] | None = None) -> Iterator[int]:
    """A chain of processes, `names[0]` at the top, each ready for SIGUSR1; yields the top's pid and
    ends the whole chain afterwards."""
    script = tmp_path / "node.py"
    script.write_text(NODE)
    clean = {key: value for key, value in os.environ.items() if key not in (SUPERVISED_ENV, RANK_EXITS_ENV, "RANK")}
    top = subprocess.Popen([sys.executable, str(script), str(tmp_path), *names], env={**clean, **(env or {})})
    try:
        wait_for_files(*(tmp_path / f"{name.removesuffix('+supervised')}.ready" for name in names))
        yield top.pid
    finally:
        processes = [psutil.Process(top.pid), *psutil.Process(top.pid).children(recursive=True)]
        for process in processes:
            process.kill()
        psutil.wait_procs(processes, timeout=10)
        top.wait()


def wait_for_files(*paths: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, [str(path) for path in paths if not path.exists()]
        time.sleep(0.05)


def signalled(tmp_path: Path) -> set[str]:
    return {path.name.removesuffix(".signalled") for path in tmp_path.glob("*.signalled")}


def test_a_rank_records_its_exit_whole_under_its_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(RANK_EXITS_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    record_rank_exit(EXIT_PREEMPTED)
    assert [path.name for path in tmp_path.iterdir()] == ["rank3"]  # no temporary file left behind
    monkeypatch.delenv("RANK")
    record_rank_exit(1)  # a launcher's only process, without RANK
    assert recorded_exits(tmp_path) == {3: EXIT_PREEMPTED, 0: 1}


@pytest.mark.parametrize("directory", [None, "missing"])
def test_without_a_directory_nothing_is_recorded(directory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(RANK_EXITS_ENV, raising=False)
    if directory is not None:
        monkeypatch.setenv(RANK_EXITS_ENV, str(tmp_path / directory))  # another node's, say
    record_rank_exit(EXIT_PREEMPTED)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "exits, launcher_code, expected",
    [
        ({0: 75, 1: 75}, 1, 75),  # torchrun's ChildFailedError, or DeepSpeed's own SIGTERM handler
        ({0: 75, 1: 75}, 75, 75),  # DeepSpeed's launch.py passing on the first rank's code
        ({1: 75}, 1, 75),  # rank 0 ended by the launcher as it left, before it could record
        ({0: 75, 1: 1}, 1, 1),  # a rank failed after the save
        ({0: 0, 1: 0}, 0, 0),
        ({}, 143, 143),  # ended before any rank recorded
        ({}, 75, 75),
    ],
)
def test_the_job_exits_75_only_when_every_recorded_rank_did(
    exits: dict[int, int], launcher_code: int, expected: int, tmp_path: Path
):
    for rank, code in exits.items():
        (tmp_path / f"rank{rank}").write_text(f"{code}\n")
    (tmp_path / ".rank2.tmp").write_text("1")  # a record still being written is not one
    assert job_exit_code(tmp_path, launcher_code) == expected
    assert main(["exit-code", str(tmp_path), str(launcher_code)]) == expected


def test_a_signal_reaches_the_rank_alone(tmp_path: Path):
    """launcher -> rank (ENGINE_SUPERVISED=1, whose parent is not) -> worker (inherits the rank's
    environment): only the rank is signalled."""
    with process_chain(tmp_path, "launcher", "rank+supervised", "worker") as launcher:
        assert forward(launcher, signal.SIGUSR1) == 1
        wait_for_files(tmp_path / "rank.signalled")
        time.sleep(0.5)  # time for a stray signal to land
    assert signalled(tmp_path) == {"rank"}


def test_before_any_rank_starts_the_launchers_whole_tree_is_signalled(tmp_path: Path):
    with process_chain(tmp_path, "launcher", "supervisor") as launcher:
        assert main(["forward", str(launcher), "USR1"]) == 0
        wait_for_files(tmp_path / "launcher.signalled", tmp_path / "supervisor.signalled")


def test_ranks_that_outlived_their_launcher_are_found_by_their_exit_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    exits = tmp_path / "exits"
    exits.mkdir()
    with process_chain(tmp_path, "launcher", "rank+supervised", env={RANK_EXITS_ENV: str(exits)}) as launcher:
        rank = psutil.Process(launcher).children()[0]
        assert stray_ranks(str(exits)) == stray_ranks(f"{tmp_path}//exits/") == [rank]
        assert stray_ranks(str(tmp_path)) == []  # another launch.sh's
        monkeypatch.setenv(RANK_EXITS_ENV, str(exits))
        assert forward(0, signal.SIGUSR1) == 1
        wait_for_files(tmp_path / "rank.signalled")
        time.sleep(0.5)
    assert signalled(tmp_path) == {"rank"}


@pytest.mark.parametrize(
    "command, rank",
    [
        (["python3", "-u", "engine/main.py", "--local_rank=0", "--deepspeed_config", "c.json"], True),
        (["python3", "-u", "/work/engine/main.py", "--deepspeed_config", "c.json"], True),  # the supervisor's child
        (["python3", "-W", "ignore", "engine/main.py"], True),
        (["python3", "/usr/bin/deepspeed", "--num_gpus", "2", "engine/main.py"], False),
        (["python3", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "engine/main.py"], False),
        (["python3", "/usr/bin/accelerate", "launch", "--cpu", "engine/main.py"], False),
    ],
)
def test_a_launcher_naming_engine_main_is_not_taken_for_a_rank(command: list[str], rank: bool):
    assert runs_engine_main(command) == rank
