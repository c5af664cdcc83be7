"""Multi-node settings read in-process: DeepSpeed hostfiles (bad lines named; include, exclude and
--num-nodes counted as DeepSpeed counts them) and the environment every rank gets. The launch.sh
checks, the two-node runs on loopback and the ssh pre-flight are in
tests/launched/test_multinode_launched.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.launch.environment import propagated_environment, user_env_files
from engine.launch.hostfile import HostfileError, active_hosts, read_hostfile
from tests.support.multinode import hostfile


@pytest.mark.parametrize(
    "text,expected",
    [
        ("worker-1 slots=8\nworker-2 slots=four\n", "hostfile:2: 'worker-2 slots=four' is not 'HOST slots=N'"),
        ("worker-1 slots=8\nworker-1 slots=8\n", "hostfile:2: host 'worker-1' is listed twice"),
        ("worker-1 slots=8\nworker-2 slots=0\n", "hostfile:2: host 'worker-2' has 0 slots"),
        ("# only a comment\n\n", "lists no hosts"),
    ],
)
def test_bad_hostfiles_name_the_line(tmp_path: Path, text: str, expected: str):
    with pytest.raises(HostfileError, match=expected):
        read_hostfile(hostfile(tmp_path, text))


def test_missing_hostfile_is_named(tmp_path: Path):
    with pytest.raises(HostfileError, match="does not exist"):
        read_hostfile(tmp_path / "nowhere")
    with pytest.raises(HostfileError, match="is a directory"):
        read_hostfile(tmp_path)


def hostfile_world_size(path: Path, include: str = "", exclude: str = "", num_nodes: int = -1) -> int:
    return sum(len(slots) for slots in active_hosts(read_hostfile(path), include, exclude, num_nodes).values())


def test_world_size_follows_deepspeeds_include_exclude_and_num_nodes(tmp_path: Path):
    path = hostfile(tmp_path, "# cluster\nworker-1 slots=8  # first\nworker-2 slots=8\nworker-3 slots=4\n")
    assert list(read_hostfile(path).items()) == [("worker-1", 8), ("worker-2", 8), ("worker-3", 4)]
    assert hostfile_world_size(path) == 20
    assert hostfile_world_size(path, num_nodes=2) == 16
    assert hostfile_world_size(path, exclude="worker-3") == 16
    assert hostfile_world_size(path, include="worker-1:0,1@worker-3") == 6
    with pytest.raises(HostfileError, match="cannot be combined"):
        active_hosts(read_hostfile(path), include="worker-1", num_nodes=1)


def test_launch_environment_keeps_what_ranks_need_and_the_users_env_file(tmp_path: Path):
    env_file = tmp_path / ".deepspeed_env"
    env_file.write_text("# cluster settings\nNCCL_IB_DISABLE=1\nOMP_NUM_THREADS=4\n")
    environ = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8", "ENGINE_FAULT": "kill,rank=1,step=3", "HOME": "/root"}
    files = user_env_files(tmp_path / "home", tmp_path, environ)
    assert files == [env_file]
    chosen = propagated_environment(environ, files)
    assert chosen == {
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_DISABLE": "1",
        "OMP_NUM_THREADS": "4",  # the file wins, as in DeepSpeed
        "ENGINE_FAULT": "kill,rank=1,step=3",
    }
    env_file.write_text("NCCL_IB_DISABLE\n")
    with pytest.raises(ValueError, match=r"\.deepspeed_env:1: 'NCCL_IB_DISABLE' is not KEY=VALUE"):
        propagated_environment(environ, files)
