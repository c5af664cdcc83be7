"""Launcher detection, the backend "auto" picks, and the accelerate settings written from a config."""

from __future__ import annotations

import pytest

from engine.launch.detect import accelerate_settings, detect_launcher, effective_backend, launch_problems

LAUNCHER_ENV = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_FSDP", "LOCAL_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for key in (*LAUNCHER_ENV, "CROSS_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env,launcher",
    [
        ({}, "none"),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, "accelerate"),
        ({"LOCAL_SIZE": "2"}, "deepspeed"),
        ({"TORCHELASTIC_RUN_ID": "none"}, "torchrun"),
    ],
)
def test_launcher_is_read_from_its_environment(clean_env, env: dict, launcher: str):
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert detect_launcher() == launcher


def test_auto_backend_follows_the_launcher_and_explicit_choices_stand():
    assert effective_backend("auto", "accelerate") == "accelerate"
    assert effective_backend("auto", "deepspeed") == "deepspeed"
    assert effective_backend("auto", "none") == "deepspeed"
    assert effective_backend("deepspeed", "accelerate") == "deepspeed"
    assert effective_backend("accelerate", "none") == "accelerate"


def test_launcher_settings_contradicting_the_config_are_named(clean_env):
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    clean_env.setenv("ACCELERATE_USE_FSDP", "true")
    problems = launch_problems("accelerate", "fp32", world_size=1)
    assert any("mixed precision 'bf16' but the config trains in fp32" in problem for problem in problems)
    assert any("--use_fsdp" in problem for problem in problems)
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "no")  # also accelerate's default without the flag
    clean_env.setenv("ACCELERATE_USE_FSDP", "false")
    assert launch_problems("accelerate", "fp32", world_size=1) == []
    assert launch_problems("accelerate", "bf16", world_size=1) == []
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert launch_problems("accelerate", "bf16", world_size=1) == []


def test_accelerate_settings_start_one_world_on_cpu():
    settings, command = accelerate_settings("bf16", num_processes=2, on_cpu=True)
    assert settings["distributed_type"] == "MULTI_GPU" and settings["num_processes"] == 2
    assert settings["mixed_precision"] == "bf16" and settings["use_cpu"] is False
    assert command.startswith("ACCELERATE_USE_CPU=1 accelerate launch --config_file {file}")
    settings, command = accelerate_settings("fp32", num_processes=8, on_cpu=False)
    assert settings["mixed_precision"] == "no" and not command.startswith("ACCELERATE_USE_CPU")
