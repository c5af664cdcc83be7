"""`make gpu-check` on a machine without a GPU, and its plan: what it would run fits the 10 minutes a
node check is allowed, and one check's failure or overrun never costs the others."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench import gpu_check
from bench.gpu_check import Check, Outcome

NODE_CHECK_LIMIT_S = 600  # issue 40: within 10 minutes on one H100


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer")
def test_without_a_gpu_it_says_so_writes_a_summary_and_exits_0(tmp_path: Path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    assert "no CUDA GPU is present on this machine; nothing to check" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["facts"]["gpu"] is None and summary["facts"]["torch"] == torch.__version__
    assert summary["checks"]["CUDA GPU"]["verdict"] == "not run"
    assert "on no CUDA GPU" in (tmp_path / "summary.md").read_text()


def test_the_planned_checks_fit_ten_minutes():
    """Every check runs by default, in order of what it proves: correctness first, then speed, then
    the long offload run; their estimated times (one H100, start-up included) add up to the limit."""
    assert gpu_check.BUDGET_S <= NODE_CHECK_LIMIT_S
    assert sum(check.estimate_s for check in gpu_check.CHECKS) <= gpu_check.BUDGET_S
    assert gpu_check.CHECKS[0].run is gpu_check.gpu_tests
    assert gpu_check.SPEED_STEPS >= 20  # at least one timed window after the first of 10 steps


def test_a_failed_or_overrunning_check_does_not_stop_the_others(tmp_path: Path):
    def passes(out: Path, seconds_left: float) -> Outcome:
        return Outcome("passed", {"tokens/s": 1234.5})

    def crashes(out: Path, seconds_left: float) -> Outcome:
        raise RuntimeError("a kernel died")

    def slow(out: Path, seconds_left: float) -> Outcome:
        time.sleep(0.3)
        return Outcome("passed")

    checks = (
        Check("a", "crashes", 0.1, crashes),
        Check("b", "slow", 0.1, slow),
        Check("c", "too long for what is left", 10, passes),
        Check("d", "passes", 0.1, passes),
    )
    assert gpu_check.run_checks(tmp_path, budget=1.0, checks=checks, keep=None) == 1
    verdicts = {
        name: check["verdict"] for name, check in json.loads((tmp_path / "summary.json").read_text())["checks"].items()
    }
    assert verdicts == {
        "crashes": "failed",
        "slow": "passed",
        "too long for what is left": "not run",
        "passes": "passed",
    }
    markdown = (tmp_path / "summary.md").read_text()
    assert "| crashes | failed (RuntimeError: a kernel died) |" in markdown
    assert "tokens/s: 1,234" in markdown
