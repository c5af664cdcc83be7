"""ENGINE_FAULT specs, parsed in-process; the faults injected into real launches are in
tests/launched/test_failures_launched.py."""

from __future__ import annotations

from engine.failures.faults import Fault, parse_fault


def test_fault_spec_parses():
    assert parse_fault("kill,rank=1,step=3") == Fault("kill", 1, 3)
    assert parse_fault("hang, rank=0, step=2, at=step") == Fault("hang", 0, 2)
