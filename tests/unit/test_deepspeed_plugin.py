"""accelerate's DeepSpeed plugin: its settings read from what `accelerate launch` exports, and every
disagreement with the engine config refused naming both the yaml and the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config
from engine.describe import check_launch
from engine.launch.deepspeed_plugin import DeepSpeedPluginSettings, deepspeed_plugin_problems, deepspeed_plugin_settings
from engine.launch.detect import LAUNCHER_PID_ENV
from engine.launch.hardware import detect_hardware
from engine.preflight import RunError
from tests.support.launcher import accelerate_launched

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny_gpt.json"
PLUGIN_ENV = {
    "ACCELERATE_USE_DEEPSPEED": "true",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage,offload_optimizer_device,gradient_clipping,mixed_precision",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "none",
    "ACCELERATE_GRADIENT_CLIPPING": "1.0",
}
# Every variable accelerate's prepare_deepspeed_cmd_env may export that the plugin reads.
EXPORTED = (
    *PLUGIN_ENV,
    "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "ACCELERATE_USE_FSDP",
    LAUNCHER_PID_ENV,
)


@pytest.fixture
def plugin_env(monkeypatch):
    """A rank's environment under `accelerate launch --config_file ds.yaml` with a ZeRO-2 plugin."""
    for key in EXPORTED:
        monkeypatch.delenv(key, raising=False)
    for key, value in PLUGIN_ENV.items():
        monkeypatch.setenv(key, value)
    return monkeypatch


@pytest.fixture(scope="module")
def zero2() -> dict:
    """The resolved document of a 2-rank ZeRO-2 tiny GPT (fp32, clipping 1.0, accumulation 1)."""
    config = load_config(CONFIG, ["zero_optimization.stage=2"], world_size=2, hardware=detect_hardware())
    return config.document


def plugin(yaml: Path | None = None, **fields) -> DeepSpeedPluginSettings:
    agreeing = dict.fromkeys(DeepSpeedPluginSettings.__dataclass_fields__)
    return DeepSpeedPluginSettings(**{**agreeing, "config_yaml": yaml, **fields})


def test_no_plugin_without_accelerates_deepspeed_variable(plugin_env):
    plugin_env.delenv("ACCELERATE_USE_DEEPSPEED")
    assert deepspeed_plugin_settings() is None


def test_settings_are_read_from_what_accelerate_launch_exports(plugin_env, tmp_path: Path):
    plugin_env.chdir(tmp_path)
    plugin_env.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "zero2.json")
    plugin_env.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "cpu")
    plugin_env.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    plugin_env.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "auto")
    plugin_env.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with accelerate_launched(["--config_file", "ds.yaml", "engine/main.py"], tmp_path):
        settings = deepspeed_plugin_settings()
    assert settings == DeepSpeedPluginSettings(
        config_yaml=tmp_path.resolve() / "ds.yaml",
        deepspeed_config_file=tmp_path.resolve() / "zero2.json",
        zero_stage=2,
        offload_optimizer_device="none",
        offload_param_device="cpu",
        zero3_save_16bit_model=True,
        mixed_precision="bf16",
        gradient_accumulation_steps=None,  # "auto": the config's own
        gradient_clipping=1.0,
    )


def test_a_mixed_precision_neither_the_yaml_nor_a_flag_gave_is_none(plugin_env):
    plugin_env.setenv("ACCELERATE_CONFIG_DS_FIELDS", "zero_stage")  # accelerate's "no" by default
    assert deepspeed_plugin_settings().mixed_precision is None


def test_a_plugin_agreeing_with_the_config_passes(zero2: dict, tmp_path: Path):
    agreeing = plugin(
        tmp_path / "ds.yaml",
        deepspeed_config_file=CONFIG,
        zero_stage=2,
        offload_optimizer_device="none",
        offload_param_device="none",
        zero3_save_16bit_model=False,
        mixed_precision="no",
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
    )
    assert deepspeed_plugin_problems(agreeing, CONFIG, "deepspeed", "fp32", zero2) == []


def test_another_deepspeed_config_file_is_refused_naming_both(zero2: dict, tmp_path: Path):
    yaml, other = tmp_path / "ds.yaml", tmp_path / "zero3.json"
    (problem,) = deepspeed_plugin_problems(
        plugin(yaml, deepspeed_config_file=other), CONFIG, "deepspeed", "fp32", zero2
    )
    assert problem.startswith(f"{yaml} sets deepspeed_config_file '{other}', but the engine trains from {CONFIG}")


def test_the_same_config_file_by_another_path_passes(zero2: dict, tmp_path: Path):
    link = tmp_path / "link.json"
    link.symlink_to(CONFIG)
    same = plugin(tmp_path / "ds.yaml", deepspeed_config_file=CONFIG)
    assert deepspeed_plugin_problems(same, link, "deepspeed", "fp32", zero2) == []


@pytest.mark.parametrize(
    "field,value,key,configured",
    [
        ("zero_stage", 3, "zero_optimization.stage", 2),
        ("offload_optimizer_device", "cpu", "zero_optimization.offload_optimizer.device", "none"),
        ("offload_param_device", "nvme", "zero_optimization.offload_param.device", "none"),
        ("zero3_save_16bit_model", True, "zero_optimization.stage3_gather_16bit_weights_on_model_save", False),
        ("gradient_accumulation_steps", 4, "gradient_accumulation_steps", 1),
        ("gradient_clipping", 0.5, "gradient_clipping", 1.0),
    ],
)
def test_each_setting_the_yaml_contradicts_is_named_with_both_files(
    zero2: dict, tmp_path: Path, field: str, value: object, key: str, configured: object
):
    yaml = tmp_path / "ds.yaml"
    (problem,) = deepspeed_plugin_problems(plugin(yaml, **{field: value}), CONFIG, "deepspeed", "fp32", zero2)
    assert problem.startswith(f"{yaml} sets {field} {value!r} but {CONFIG} has {key} {configured!r}"), problem


def test_a_mixed_precision_mismatch_names_the_yaml(zero2: dict, tmp_path: Path):
    yaml = tmp_path / "ds.yaml"
    (problem,) = deepspeed_plugin_problems(plugin(yaml, mixed_precision="fp16"), CONFIG, "deepspeed", "fp32", zero2)
    assert "mixed_precision 'fp16' but the config trains in fp32" in problem
    assert str(CONFIG) in problem


def test_the_accelerate_backend_under_a_deepspeed_yaml_is_refused(zero2: dict, tmp_path: Path):
    yaml = tmp_path / "ds.yaml"
    (problem,) = deepspeed_plugin_problems(plugin(yaml, zero_stage=3), CONFIG, "accelerate", "fp32", zero2)
    assert problem.startswith(
        f'{yaml} asks for DeepSpeed (distributed_type: DEEPSPEED) but {CONFIG} sets trainer.backend "accelerate"'
    )


def test_one_rank_is_held_to_the_stage_written_not_the_fast_paths(plugin_env, tmp_path: Path):
    """On one rank `trainer.single_rank_fast_path` runs ZeRO-2 as stage 0: the yaml's 2 still agrees."""
    plugin_env.delenv("WORLD_SIZE", raising=False)
    hardware = detect_hardware()
    config = load_config(CONFIG, ["zero_optimization.stage=2"], world_size=1, hardware=hardware)
    assert config.zero_stage == 0 and config.rerouted
    with accelerate_launched(["--config_file", "ds.yaml", "engine/main.py"], tmp_path):
        check_launch(config, str(CONFIG))
        plugin_env.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
        with pytest.raises(RunError) as refused:
            check_launch(config, str(CONFIG))
    assert f"{tmp_path.resolve() / 'ds.yaml'} sets zero_stage 3 but {CONFIG} has zero_optimization.stage 2" in str(
        refused.value
    )
