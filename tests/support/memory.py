"""The planner's prediction of each rank's model states against what the rank measured."""

from __future__ import annotations

from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.plan import Plan, plan_run
from engine.preflight import check_data
from tests.support.launch import Run, _text

EXACT_KEYS = {"parameter_bytes": "parameter", "gradient_bytes": "gradient", "optimizer_bytes": "optimizer"}


def assert_plan_matches_measured(run: Run, config: str, overrides: dict, world_size: int) -> Plan:
    """Parameters, gradients and optimizer states of every rank, predicted on the meta device,
    equal the bytes the rank held in the run's last logged step. Returns the plan."""
    sets = [f"{key}={_text(value)}" for key, value in overrides.items()]
    hardware = detect_hardware(local_world_size=world_size)
    plan = plan_run(check_data(load_config(config, sets, world_size=world_size, hardware=hardware))[0])
    measured = run.records[-1]["ranks"]
    assert len(measured) == world_size, measured
    for predicted, held in zip(plan.ranks, measured, strict=True):
        expected = {key: getattr(predicted.states, field) for key, field in EXACT_KEYS.items()}
        actual = {key: held[key] for key in EXACT_KEYS}
        assert actual == expected, f"rank {predicted.rank}: measured {actual}, planned {expected}"
    return plan
