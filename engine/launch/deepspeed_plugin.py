"""accelerate's DeepSpeed plugin: what `accelerate launch --config_file ds.yaml` (a yaml with
`distributed_type: DEEPSPEED`) asked for, and where that disagrees with the engine's config.

accelerate hands its DeepSpeed settings to each rank as ACCELERATE_* variables (its
`prepare_deepspeed_cmd_env`) and keeps the yaml's path to itself; the path is read from the
launcher's command line (engine/launch/detect.py) so that every message can name the yaml beside
the engine config. The engine trains from its own config: the yaml may agree with it, or fill its
"auto" values, but never overrule it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.launch.detect import accelerate_config_file, deepspeed_plugin_requested, launcher_option, precision_problem

# accelerate's own map from plugin fields to DeepSpeed config keys (DeepSpeedPlugin.__post_init__).
PLUGIN_TO_CONFIG = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
}


@dataclass(frozen=True)
class DeepSpeedPluginSettings:
    """The DeepSpeed settings `accelerate launch` passed to this rank, from its yaml or its flags.
    None: neither gave that setting, so the engine config's own value stands."""

    config_yaml: Path | None  # the yaml accelerate read; None for flags alone, or an unreadable command line
    deepspeed_config_file: Path | None  # absolute
    zero_stage: int | None
    offload_optimizer_device: str | None  # "none", "cpu" or "nvme"
    offload_param_device: str | None
    zero3_save_16bit_model: bool | None
    mixed_precision: str | None  # accelerate's spelling: "no", "bf16", "fp16" or "fp8"
    gradient_accumulation_steps: int | None
    gradient_clipping: float | None


def deepspeed_plugin_settings() -> DeepSpeedPluginSettings | None:
    """The plugin's settings, or None when this process was not started by `accelerate launch`
    with a DeepSpeed plugin."""
    if not deepspeed_plugin_requested():
        return None
    env = os.environ
    config_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    save_16bit = env.get("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL")
    return DeepSpeedPluginSettings(
        config_yaml=accelerate_config_file(),
        deepspeed_config_file=Path(config_file).resolve() if config_file else None,
        zero_stage=_integer(env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")),
        offload_optimizer_device=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
        offload_param_device=env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
        zero3_save_16bit_model=None if save_16bit is None else save_16bit.lower() == "true",
        mixed_precision=_requested_precision(),
        gradient_accumulation_steps=_integer(env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")),
        gradient_clipping=_number(env.get("ACCELERATE_GRADIENT_CLIPPING")),
    )


def _integer(value: str | None) -> int | None:
    """A whole number, or None for unset or accelerate's "auto"."""
    return int(value) if value is not None and value.isdigit() else None


def _number(value: str | None) -> float | None:
    """A float, or None for unset or accelerate's "auto" (or "none")."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _requested_precision() -> str | None:
    """accelerate's mixed precision where the yaml or --mixed_precision gave one: the launcher
    always exports a value, "no" by default, and lists in ACCELERATE_CONFIG_DS_FIELDS the fields
    that came from the yaml."""
    from_yaml = "mixed_precision" in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    if from_yaml or launcher_option("mixed_precision") is not None:
        return os.environ.get("ACCELERATE_MIXED_PRECISION")
    return None


def deepspeed_plugin_problems(
    plugin: DeepSpeedPluginSettings, config_path: Path, backend: str, precision: str, document: dict[str, Any]
) -> list[str]:
    """Every way the plugin disagrees with the engine config at `config_path` (resolved: `backend`,
    `precision`, and its DeepSpeed keys in `document`), each naming both files."""
    config_path = config_path.resolve()
    if backend == "accelerate":
        yaml = plugin.config_yaml or "accelerate launch --use_deepspeed"
        return [
            f"{yaml} asks for DeepSpeed (distributed_type: DEEPSPEED) but {config_path} sets trainer.backend "
            '"accelerate"; set it to "auto" or "deepspeed", or launch with the accelerate settings '
            f"`python -m engine accelerate-config {config_path}` writes"
        ]
    problems = []
    if plugin.deepspeed_config_file is not None and plugin.deepspeed_config_file != config_path:
        problems.append(
            f"{_given('deepspeed_config_file', str(plugin.deepspeed_config_file), plugin)}, but the engine trains from "
            f"{config_path} alone; point deepspeed_config_file at {config_path} or remove it"
        )
    for field, key in PLUGIN_TO_CONFIG.items():
        wanted, configured = getattr(plugin, field), _lookup(document, key)
        if wanted is not None and wanted != configured:
            problems.append(
                f"{_given(field, wanted, plugin)} but {config_path} has {key} {configured!r}; the config decides, "
                f"so make them agree (or drop {field})"
            )
    problem = precision_problem(plugin.mixed_precision or "no", precision, config_path, plugin.config_yaml)
    return problems + ([problem] if problem is not None else [])


def _given(field: str, value: object, plugin: DeepSpeedPluginSettings) -> str:
    """A plugin setting as a message names it: the flag that gave it, else the yaml that did."""
    if launcher_option(field) is not None or plugin.config_yaml is None:
        return f"accelerate launch was given --{field} {value}"
    return f"{plugin.config_yaml} sets {field} {value!r}"


def _lookup(document: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted DeepSpeed key, as accelerate's plugin map names it."""
    value = document
    for part in dotted.split("."):
        value = value[part]
    return value
