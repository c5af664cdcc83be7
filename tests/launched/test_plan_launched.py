"""The `plan` and `explain` commands as a user runs them (`python -m engine`, CUDA hidden): a plan
that fits says so, one that does not says by how much, each rank is told its place and share, and
bad input is refused with one message. The planner itself is tested in tests/unit/test_plan.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.launch import ROOT
from tests.support.plan import GPT2, VOCAB


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command checks the data as a launch would; synthetic data fills any batch. CUDA hidden, so
    the plan is of a CPU machine wherever the test runs."""
    command = [sys.executable, "-m", "engine", *args, "--set=data.type=synthetic"]
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=environment)


def test_cli_plan_fits_512gib_of_host_and_says_so():
    result = run_cli(
        "plan",
        GPT2,
        f"--set=model.vocab_size={VOCAB}",
        "--world-size",
        "8",
        "--host-memory",
        "512GiB",
        "--set",
        "zero_optimization.stage=3",
        "--set",
        "zero_optimization.offload_optimizer.device=cpu",
    )
    assert result.returncode == 0, result.stderr
    assert "no accelerator here" in result.stdout and "data:" in result.stdout
    assert "host:" in result.stdout and "fits" in result.stdout and "does not fit" not in result.stdout


def test_cli_plan_reports_by_how_much_it_does_not_fit():
    result = run_cli("plan", GPT2, "--world-size", "2", "--host-memory", "1GiB")
    assert result.returncode == 1
    assert "does not fit" in result.stdout and "over" in result.stdout


def test_cli_plan_refuses_a_device_budget_where_there_is_no_device():
    result = run_cli("plan", "configs/tiny_gpt.json", "--device-memory", "80GiB")
    assert result.returncode == 2
    assert "no accelerator" in result.stderr and "--host-memory" in result.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--device-memory", "80GB?"], "'80GB?' is not a memory size"),
        (["--set", "model.n_layers=3"], "model.n_layers"),
    ],
)
def test_cli_plan_refuses_bad_input_with_one_message(args: list[str], expected: str):
    result = run_cli("plan", "configs/tiny_gpt.json", "--world-size", "2", *args)
    assert result.returncode == 2
    assert expected in result.stderr


def test_explain_tells_each_rank_its_place_and_share():
    result = run_cli("explain", "configs/3d.json", "--world-size", "8")
    assert result.returncode == 0, result.stderr
    assert "rank 3: stage 1 of 2" in result.stdout
    assert "TP shard 2 of 2" in result.stdout
