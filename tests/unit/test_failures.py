"""ENGINE_FAULT specs, parsed in-process; the faults injected into real launches are in
tests/launched/test_failures_launched.py."""

from __future__ import annotations

import pytest

from engine.failures.faults import Fault, parse_fault


def test_fault_spec_parses():
    assert parse_fault("kill,rank=1,step=3") == Fault("kill", 1, 3)
    assert parse_fault("hang, rank=0, step=2, at=step") == Fault("hang", 0, 2)


def test_a_signal_goes_to_the_rank_its_launcher_or_the_command_the_user_typed():
    assert parse_fault("signal,rank=0,step=3,to=top") == Fault("signal", 0, 3, to="top")
    assert parse_fault("signal,rank=0,step=3,to=launcher,sig=SIGUSR1").to == "launcher"
    with pytest.raises(ValueError, match="to=shell is not self, launcher or top"):
        parse_fault("signal,rank=0,step=3,to=shell")
