"""Stopping early with a save: the config's signal names and durations, the signal handling of one
process (in a child, so this test process keeps its own handlers), and the wall-clock rule."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.config.stop_settings import parse_duration, signal_number
from engine.describe import describe_run
from engine.failures.preemption import StopRequests, estimated_save_s
from engine.launch.signals import EXIT_PREEMPTED
from engine.preflight import RunError
from tests.support.config import with_changes
from tests.support.launch import ROOT
from tests.unit.test_config import issues_of


@pytest.mark.parametrize(
    "text, seconds",
    [("01:30:00", 5400), ("1-00:00:00", 86400), ("30:00", 1800), ("1h30m", 5400), ("90m", 5400), ("45s", 45)],
)
def test_durations_read_as_schedulers_write_them(text: str, seconds: float):
    assert parse_duration(text) == seconds


def test_signal_names_with_or_without_sig():
    assert signal_number("SIGUSR1") == signal_number("usr1") == signal.SIGUSR1
    with pytest.raises(ValueError, match="cannot be caught"):
        signal_number("SIGKILL")


def test_bad_signal_names_and_durations_are_refused_by_the_config():
    issues = issues_of(with_changes(trainer__signals=["SIGTERM", "SIGBOGUS"], trainer__max_wall_time="ninety"))
    assert any(issue.startswith("trainer.signals[1]: 'SIGBOGUS' is not a signal name") for issue in issues), issues
    assert any(issue.startswith("trainer.max_wall_time: 'ninety' is not a duration") for issue in issues), issues


def test_a_wall_time_shorter_than_one_save_is_refused_before_any_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    document = json.loads((ROOT / "configs" / "tiny_gpt.json").read_text())
    document["model"].update(preset="124M")
    for key in ("n_layer", "n_head", "n_embd", "n_positions"):
        document["model"].pop(key)
    document["trainer"].update(max_wall_time="2s", output_dir=str(tmp_path / "run"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RunError, match=r"trainer.max_wall_time '2s' is shorter than one save of this model"):
        describe_run(str(path), [])


def test_the_wall_clock_rule_leaves_room_for_a_save_and_a_step():
    stops = StopRequests([], grace_s=10, max_wall_s=100.0)
    stops.started = time.time() - 80  # 80 s gone, 20 s left
    assert stops.reason_to_stop(step_s=1.0, last_save_s=5.0, parameters=0) is None
    reason = stops.reason_to_stop(step_s=1.0, last_save_s=19.5, parameters=0)
    assert reason.startswith("trainer.max_wall_time 0:01:40: stopping with 0:00:2")
    fresh = StopRequests([], grace_s=10, max_wall_s=100.0)
    fresh.started = time.time() - 80
    # 56 s estimated for the first save
    assert fresh.reason_to_stop(step_s=1.0, last_save_s=None, parameters=int(2e9)) is not None
    assert estimated_save_s(int(2e9)) == pytest.approx(56.0)


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from engine.failures.preemption import StopRequests
    stops = StopRequests([signal.SIGTERM, signal.SIGUSR1], grace_s=float(sys.argv[1]), max_wall_s=None).install()
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a copy of the same request (a launcher and a supervisor)
    time.sleep(0.5)
    print("signalled", stops.signalled(), stops.reason_to_stop(0.0, None, 0), flush=True)
    if sys.argv[2] == "again":
        time.sleep(2.5)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print("still running", flush=True)
    """
)


def run_child(grace_s: float, then: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", CHILD, str(grace_s), then], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_signal_is_recorded_and_its_copies_count_once():
    child = run_child(grace_s=30, then="wait")
    assert "signalled True SIGUSR1 received" in child.stdout, child.stdout + child.stderr
    assert "still running" in child.stdout
    assert child.returncode == 0


def test_a_second_signal_ends_the_process_at_once():
    child = run_child(grace_s=30, then="again")
    assert "second signal (SIGTERM): ending without a save" in child.stdout
    assert "still running" not in child.stdout
    assert child.returncode == 128 + signal.SIGTERM


def test_the_grace_period_ends_a_save_that_does_not_finish():
    child = run_child(grace_s=2, then="wait")
    assert "no save within trainer.signal_grace_s (2 s)" in child.stdout
    assert child.returncode == 128 + signal.SIGUSR1


def test_the_preempted_exit_code_is_distinct():
    assert EXIT_PREEMPTED not in (0, 1, 2) and EXIT_PREEMPTED < 128
