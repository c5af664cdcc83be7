"""The DeepSpeed part of the schema follows DeepSpeed's own models; HF's "auto" resolves by one
rule each; what a backend cannot honour is refused naming it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import deepspeed
import pytest
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from engine.cli import main
from engine.config import schema
from engine.config.deepspeed_schema import deprecated, removed_keys, spelling
from engine.config.errors import ConfigError
from engine.config.load import check_document
from engine.config.resolve import resolve
from engine.config.schema import SCHEMA
from tests.support.config import BASE, with_changes
from tests.unit.test_config import CPU, GPU, issues_of


@pytest.mark.parametrize(
    "section, model",
    [("zero_optimization", DeepSpeedZeroConfig), ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config)],
)
def test_every_current_field_of_deepspeeds_model_is_in_the_schema(section: str, model: type):
    properties = SCHEMA["properties"][section]["properties"]
    current = {spelling(name, field) for name, field in model.model_fields.items() if not deprecated(field)}
    assert current <= set(properties), current - set(properties)
    assert all(properties[key].get("description") for key in current)


def test_keys_deepspeed_honours_and_users_write_are_accepted():
    document = with_changes(
        prescale_gradients=False,
        zero_optimization={
            "stage": 2,
            "memory_efficient_linear": True,
            "stage3_gather_fp16_weights_on_model_save": False,
        },
        data_types={"grad_accum_dtype": "fp32"},
        fp16={"auto_cast": False},
        optimizer={"type": "AdamW", "params": {"bias_correction": True}},
        hybrid_engine={"enabled": False},
    )
    filled = check_document(document, 2, CPU)
    assert filled["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is False
    assert "stage3_gather_fp16_weights_on_model_save" not in filled["zero_optimization"]


@pytest.mark.parametrize("path", sorted(removed_keys()), ids=lambda path: ".".join(path))
def test_keys_deepspeed_removed_are_refused_with_its_reason(path: tuple):
    document = copy.deepcopy(BASE)
    section = document
    for key in path[:-1]:
        section = section.setdefault(key, {})
    section[path[-1]] = {}
    (issue,) = issues_of(document)
    assert issue == f"{'.'.join(path)}: removed from DeepSpeed: {removed_keys()[path]}"


def test_an_old_spelling_beside_its_current_key_is_refused():
    document = with_changes(zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    document["zero_optimization"]["stage3_gather_fp16_weights_on_model_save"] = True
    (issue,) = issues_of(document)
    assert issue.startswith(
        "zero_optimization.stage3_gather_fp16_weights_on_model_save: an older spelling of "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    )


def test_hf_auto_takes_the_engines_defaults():
    document = with_changes(
        optimizer={"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        trainer__max_steps=1000,
    )
    resolved = resolve(check_document(document, 1, CPU), 1, CPU).document
    assert resolved["optimizer"]["params"] | {"torch_adam": True} == {
        "lr": 3e-4,
        "betas": [0.9, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adam_w_mode": True,
        "torch_adam": True,
        "fused": False,  # torch's fused kernel is for parameters on a GPU
    }
    assert resolved["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 10,
        "warmup_type": "log",
    }


def test_an_all_auto_batch_resolves_from_the_default_micro_batch_and_the_world():
    document = with_changes(
        train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto"
    )
    resolved = resolve(check_document(document, 4, GPU), 4, GPU).document
    assert (
        resolved["train_batch_size"],
        resolved["train_micro_batch_size_per_gpu"],
        resolved["gradient_accumulation_steps"],
    ) == (32, 8, 1)


def test_an_absent_batch_is_still_refused():
    document = copy.deepcopy(BASE)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        document.pop(key, None)
    assert any(issue.startswith("train_batch_size: set train_batch_size or") for issue in issues_of(document))


@pytest.mark.parametrize(
    "changes, path",
    [
        ({"wall_clock_breakdown": True}, "wall_clock_breakdown"),
        ({"zero_optimization": {"stage": 2, "overlap_comm": True}}, "zero_optimization.overlap_comm"),
        (
            {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500_000_000}},
            "zero_optimization.reduce_bucket_size",
        ),
        ({"steps_per_print": 10}, "steps_per_print"),
        (
            {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        ),
    ],
)
def test_deepspeed_only_keys_are_refused_under_accelerate_naming_the_backend(changes: dict, path: str):
    document = with_changes(trainer__backend="accelerate", **changes)
    issues = [issue for issue in issues_of(document) if issue.startswith(f"{path}:")]
    assert len(issues) == 1 and "accelerate backend (trainer.backend)" in issues[0], issues_of(document)


def test_deepspeed_only_keys_left_off_or_auto_pass_under_accelerate():
    document = with_changes(
        trainer__backend="accelerate",
        wall_clock_breakdown=False,
        zero_optimization={"stage": 2, "overlap_comm": False, "reduce_bucket_size": "auto"},
    )
    check_document(document, 2, CPU)


@pytest.mark.parametrize(
    "changes, path, phrase",
    [
        ({"hybrid_engine": {"enabled": True}}, "hybrid_engine", "valid DeepSpeed, but not supported by this engine"),
        ({"tensor_parallel": {"autotp_size": 1, "preset_model": "llama"}}, "tensor_parallel", "keep only the size"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"}}},
            "zero_optimization.offload_optimizer.device",
            "DeepSpeed offloads to NVMe under ZeRO stage 3 only; at stage 2",
        ),
        (
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/local", "buffer_count": 3},
                }
            },
            "zero_optimization.offload_optimizer.buffer_count",
            "3 is too few: DeepSpeed swaps each sub-group's master, 2 optimizer state(s) and gradient",
        ),
        (
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
            "zero_optimization.offload_param.nvme_path",
            'required with device "nvme"',
        ),
        (
            {
                "trainer": {"backend": "accelerate"},
                "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local"}},
            },
            "zero_optimization.offload_optimizer.device",
            "torch's FSDP under the accelerate backend offloads to host memory only",
        ),
        ({"optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type", "'Lamb' is a DeepSpeed optimizer"),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            "activation_checkpointing",
            "deepspeed.checkpointing.configure",
        ),
        (
            {"activation_checkpointing": {"cpu_checkpointing": True}, "parallel": {"pipeline_parallel_size": 2}},
            "activation_checkpointing",
            "parallel.pipeline_activation_checkpoint_interval",
        ),
    ],
)
def test_deepspeed_features_the_engine_cannot_honour_say_why(changes: dict, path: str, phrase: str):
    issues = [issue for issue in issues_of(with_changes(**changes)) if issue.startswith(f"{path}:")]
    assert len(issues) == 1 and phrase in issues[0], issues


def test_every_problem_is_listed_at_once():
    document = with_changes(sparse_attention={}, optimizer={"type": "AdamW", "params": {"max_grad_norm": 1.0}})
    with pytest.raises(ConfigError) as raised:
        check_document(document, 1, CPU)
    assert sorted(str(issue).partition(":")[0] for issue in raised.value.issues) == [
        "optimizer.params.max_grad_norm",
        "sparse_attention",
    ]


def test_validate_prints_the_notices_and_the_resolved_autos(tmp_path: Path, capsys: pytest.CaptureFixture):
    document = with_changes(
        train_batch_size="auto",
        train_micro_batch_size_per_gpu="auto",
        optimizer={"type": "AdamW", "params": {"lr": "auto"}},
        zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
    )
    document["bfloat16"] = {"enabled": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    assert main(["validate", str(path), "--world-size", "2", "--print-resolved", "--no-hardware-check"]) == 0
    printed = capsys.readouterr().out
    assert "bfloat16 is deprecated in DeepSpeed; read as bf16\n" in printed
    assert "stage3_gather_fp16_weights_on_model_save is deprecated in DeepSpeed; read as " in printed
    resolved = json.loads(printed[printed.index("\n{") :])
    assert resolved["optimizer"]["params"]["lr"] == 3e-4
    assert (resolved["train_micro_batch_size_per_gpu"], resolved["train_batch_size"]) == (8, 16)
    assert resolved["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_the_plugin_keys_auto_come_from_accelerates_deepspeed_yaml(monkeypatch: pytest.MonkeyPatch):
    document = with_changes(
        zero_optimization={
            "stage": "auto",
            "offload_optimizer": {"device": "auto"},
            "stage3_gather_16bit_weights_on_model_save": "auto",
        }
    )
    zero = check_document(document, 2, CPU)["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["stage3_gather_16bit_weights_on_model_save"]) == (
        0,
        "none",
        False,
    )
    for name, value in {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
    }.items():
        monkeypatch.setenv(name, value)
    zero = check_document(document, 2, CPU)["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["stage3_gather_16bit_weights_on_model_save"]) == (
        3,
        "cpu",
        True,
    )


def test_every_key_written_by_hand_is_one_deepspeed_reads():
    """The sections DeepSpeed reads without a pydantic model are typed by hand here: each key must be
    a string DeepSpeed's own source looks up, so a misspelt key cannot be accepted and then ignored."""
    source = "\n".join(path.read_text(errors="ignore") for path in Path(deepspeed.__file__).parent.rglob("*.py"))
    sections = [
        schema._DEEPSPEED_SCALARS,
        schema._FEATURES,
        schema._ACTIVATION_CHECKPOINTING["properties"],
        schema._FLOPS_PROFILER["properties"],
        schema._CHECKPOINT["properties"],
        schema._CHECKPOINT["properties"]["parallel_write"]["properties"],
        schema._DATA_TYPES["properties"],
        schema._PIPELINE["properties"],
    ]
    # DeepSpeed's spellings of the engine's keys are read as those, never passed on.
    spelled = {spelling.path[-1] for spelling in schema.SPELLINGS}
    keys = {key for section in sections for key in section} - spelled
    assert [key for key in sorted(keys) if f'"{key}"' not in source and f"'{key}'" not in source] == []
