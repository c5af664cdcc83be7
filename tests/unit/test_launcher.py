"""Launcher detection, the backend "auto" picks, and the accelerate settings written from a config."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.launch.detect import (
    LAUNCHER_PID_ENV,
    accelerate_config_file,
    accelerate_requested_processes,
    accelerate_settings,
    detect_launcher,
    effective_backend,
    launch_problems,
    launcher_option,
)
from tests.support.launcher import accelerate_launched

LAUNCHER_ENV = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_FSDP", "LOCAL_SIZE")
CONFIG = Path("configs/tiny_gpt.json")


@pytest.fixture
def clean_env(monkeypatch):
    for key in (*LAUNCHER_ENV, "CROSS_RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_DEEPSPEED", LAUNCHER_PID_ENV):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env,launcher",
    [
        ({}, "none"),
        ({"ACCELERATE_MIXED_PRECISION": "no"}, "accelerate"),
        ({"LOCAL_SIZE": "2"}, "deepspeed"),
        ({"TORCHELASTIC_RUN_ID": "none"}, "torchrun"),
        (
            {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_DEEPSPEED": "true", "TORCHELASTIC_RUN_ID": "none"},
            "accelerate",
        ),
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


def test_auto_backend_is_deepspeed_under_accelerates_deepspeed_plugin(clean_env):
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "no")
    clean_env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert detect_launcher() == "accelerate"
    assert effective_backend("auto") == "deepspeed"
    assert effective_backend("accelerate") == "accelerate"  # a contradiction deepspeed_plugin_problems refuses
    clean_env.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert effective_backend("auto") == "accelerate"


def test_launcher_settings_contradicting_the_config_are_named(clean_env):
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    clean_env.setenv("ACCELERATE_USE_FSDP", "true")
    problems = launch_problems("accelerate", "fp32", 1, CONFIG)
    assert any("mixed precision 'bf16' but the config trains in fp32" in problem for problem in problems)
    assert any("--use_fsdp" in problem for problem in problems)
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "no")  # also accelerate's default without the flag
    clean_env.setenv("ACCELERATE_USE_FSDP", "false")
    assert launch_problems("accelerate", "fp32", 1, CONFIG) == []
    assert launch_problems("accelerate", "bf16", 1, CONFIG) == []
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert launch_problems("accelerate", "bf16", 1, CONFIG) == []


def test_launcher_options_are_read_from_the_launchers_command_line(clean_env, tmp_path: Path):
    assert launcher_option("num_processes") is None and accelerate_config_file() is None  # no accelerate above
    arguments = ["--num-processes=2", "--config_file", "ds.yaml", "--mixed_precision", "bf16", "engine/main.py"]
    with accelerate_launched([*arguments, "--set", "trainer.max_steps=5"], tmp_path):
        assert accelerate_requested_processes() == 2
        assert launcher_option("mixed_precision") == "bf16"
        assert launcher_option("zero_stage") is None
        assert accelerate_config_file() == tmp_path.resolve() / "ds.yaml"  # relative to the launcher's directory


def test_accelerates_default_config_file_is_named_unless_cpu_skips_it(clean_env, tmp_path: Path):
    import accelerate.commands.config

    default = tmp_path / "default_config.yaml"
    clean_env.setattr(accelerate.commands.config, "default_config_file", str(default))
    with accelerate_launched(["engine/main.py"], tmp_path):
        assert accelerate_config_file() is None  # none written yet
        default.write_text("distributed_type: DEEPSPEED\n")
        assert accelerate_config_file() == default
    with accelerate_launched(["--cpu", "engine/main.py"], tmp_path):
        assert accelerate_config_file() is None


def test_a_mixed_precision_from_the_yaml_names_the_yaml(clean_env, tmp_path: Path):
    clean_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with accelerate_launched(["--config_file", "ds.yaml", "engine/main.py"], tmp_path):
        (problem,) = launch_problems("accelerate", "fp32", 1, CONFIG)
    assert problem.startswith(f"{tmp_path.resolve() / 'ds.yaml'} sets mixed_precision 'bf16' but the config trains")
    assert str(CONFIG) in problem and problem.endswith("so set it to 'no' there")
    flags = ["--config_file", "ds.yaml", "--mixed_precision", "bf16", "engine/main.py"]
    with accelerate_launched(flags, tmp_path):
        (problem,) = launch_problems("accelerate", "fp32", 1, CONFIG)
    assert problem.startswith("accelerate launch was given mixed precision 'bf16'")


def test_accelerate_settings_start_one_world_on_cpu():
    settings, command = accelerate_settings("bf16", num_processes=2, on_cpu=True)
    assert settings["distributed_type"] == "MULTI_GPU" and settings["num_processes"] == 2
    assert settings["mixed_precision"] == "bf16" and settings["use_cpu"] is False
    assert command.startswith("ACCELERATE_USE_CPU=1 accelerate launch --config_file {file}")
    settings, command = accelerate_settings("fp32", num_processes=8, on_cpu=False)
    assert settings["mixed_precision"] == "no" and not command.startswith("ACCELERATE_USE_CPU")
