"""DeepSpeed's own spellings of what the engine runs itself are read as the engine's keys, one
notice line each, and refused naming both keys where they disagree with them; Adam without bias
correction runs on DeepSpeed's Adam, and the single-process reference steps it by the formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.config import get_pipeline_config

from engine.config import ConfigError, EngineConfig, load_config
from engine.launch.hardware import Hardware
from engine.launch.ops import ops_needed
from engine.parallel.layout import parallel_layout
from tests.support.launch import ROOT
from tests.support.reference import UncorrectedAdam
from tests.unit.test_config import CPU, GPU

TINY_GPT = json.loads((ROOT / "configs" / "tiny_gpt.json").read_text())
TINY_RESNET = json.loads((ROOT / "configs" / "tiny_resnet.json").read_text())
# The issue's 3D example as DeepSpeed's users write it: 4 stages x 2 shards x 2 replicas at 16 ranks.
THREE_D = {
    "train_batch_size": 512,
    "pipeline": {"pipeline_parallel_size": 4, "pipe_partitioned": True},
    "tensor_parallel": {"tp_size": 2},
    "zero_optimization": {"stage": 1},
}


def write(directory: Path, document: dict) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(document))
    return path


def tiny_gpt(n_layer: int = 2, **deepspeed_sections: dict) -> dict:
    """configs/tiny_gpt.json with `n_layer` blocks and DeepSpeed sections laid over its own."""
    return {**TINY_GPT, "model": {**TINY_GPT["model"], "n_layer": n_layer}, **deepspeed_sections}


def load(directory: Path, document: dict, world_size: int, hardware: Hardware = CPU, sets: tuple = ()) -> EngineConfig:
    return load_config(write(directory, document), list(sets), world_size=world_size, hardware=hardware)


def refusals(directory: Path, document: dict, world_size: int, hardware: Hardware = CPU) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        load(directory, document, world_size, hardware)
    return [str(issue) for issue in raised.value.issues]


TP, PP = "the tensor-parallel degree", "the pipeline-stage count"


@pytest.mark.parametrize(
    "sections, spelled, feature, key, value",
    [
        ({"tensor_parallel": {"tp_size": 2}}, "tensor_parallel.tp_size", TP, "tensor_parallel_size", 2),
        ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size", TP, "tensor_parallel_size", 2),
        # DeepSpeed reads an AutoTP size of 0 as AutoTP off.
        ({"tensor_parallel": {"autotp_size": 0}}, "tensor_parallel.autotp_size", TP, "tensor_parallel_size", 1),
        (
            {"pipeline": {"pipeline_parallel_size": 2}},
            "pipeline.pipeline_parallel_size",
            PP,
            "pipeline_parallel_size",
            2,
        ),
        (
            {"pipeline": {"activation_checkpoint_interval": 1}, "parallel": {"pipeline_parallel_size": 2}},
            "pipeline.activation_checkpoint_interval",
            "the pipeline's activation-checkpoint interval",
            "pipeline_activation_checkpoint_interval",
            1,
        ),
    ],
    ids=["tp_size", "autotp_size", "autotp_size_0", "pipeline_parallel_size", "activation_checkpoint_interval"],
)
def test_each_spelling_is_read_as_the_engines_key_with_one_notice(
    sections: dict, spelled: str, feature: str, key: str, value: int, tmp_path: Path
):
    config = load(tmp_path, tiny_gpt(**sections), world_size=2)
    assert config.notices == (f"{spelled} is DeepSpeed's spelling of {feature}; read as parallel.{key}",)
    assert config.document["parallel"][key] == value
    # Nothing of them reaches DeepSpeed, whose AutoTP would rewrite the model a second time.
    assert spelled.split(".")[0] not in config.deepspeed_config()


def test_a_spelling_beside_the_engines_key_with_the_same_value_is_read_once(tmp_path: Path):
    document = tiny_gpt(tensor_parallel={"tp_size": 2, "autotp_size": 2}, parallel={"tensor_parallel_size": 2})
    config = load(tmp_path, document, world_size=2)
    assert config.parallel.tensor_parallel_size == 2 and "tensor_parallel" not in config.deepspeed_config()
    assert len(config.notices) == 2


@pytest.mark.parametrize(
    "sections, expected",
    [
        (
            {"tensor_parallel": {"tp_size": 2}, "parallel": {"tensor_parallel_size": 4}},
            "tensor_parallel.tp_size: 2 here, but parallel.tensor_parallel_size is 4; both set the tensor-parallel "
            "degree, so keep one of them (or give them the same value)",
        ),
        (
            {"tensor_parallel": {"tp_size": 2, "autotp_size": 4}},
            "tensor_parallel.autotp_size: 4 here, but tensor_parallel.tp_size is 2; both set the tensor-parallel "
            "degree, so keep one of them (or give them the same value)",
        ),
        (
            {"pipeline": {"pipeline_parallel_size": 2}, "parallel": {"pipeline_parallel_size": 1}},
            "pipeline.pipeline_parallel_size: 2 here, but parallel.pipeline_parallel_size is 1; both set the "
            "pipeline-stage count, so keep one of them (or give them the same value)",
        ),
    ],
    ids=["tp_size_and_engine_key", "two_spellings", "pipeline_parallel_size_and_engine_key"],
)
def test_a_spelling_that_disagrees_is_refused_naming_both_keys(sections: dict, expected: str, tmp_path: Path):
    assert refusals(tmp_path, tiny_gpt(**sections), world_size=8) == [expected]


def test_an_override_of_the_engines_key_replaces_the_files_spelling(tmp_path: Path):
    """`--set` wins over the file, as for any key: `python -m engine plan` searches layouts so."""
    document = tiny_gpt(
        tensor_parallel={"tp_size": 2}, pipeline={"pipeline_parallel_size": 2, "pipe_partitioned": True}
    )
    sets = ("parallel.tensor_parallel_size=1", "parallel.pipeline_parallel_size=2")
    config = load(tmp_path, document, world_size=2, sets=sets)
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size) == (1, 2)
    assert config.notices == ()
    assert config.deepspeed_config()["pipeline"] == {"pipe_partitioned": True}


def test_a_family_without_a_tensor_parallel_plan_is_refused_with_the_reason(tmp_path: Path):
    document = {**TINY_RESNET, "tensor_parallel": {"tp_size": 2}}
    assert refusals(tmp_path, document, world_size=2) == [
        "parallel.tensor_parallel_size: resnet models have no tensor-parallel form (convolutions split poorly); set "
        "it to 1 and use data or pipeline parallelism"
    ]


def test_autotps_own_options_are_refused_beside_the_size_it_reads(tmp_path: Path):
    document = tiny_gpt(tensor_parallel={"autotp_size": 2, "preset_model": "llama"})
    (issue,) = refusals(tmp_path, document, world_size=2)
    assert issue.startswith("tensor_parallel: valid DeepSpeed, but not supported by this engine: AutoTP's options")
    assert issue.endswith("so keep only the size")


def test_pipe_and_grad_partitioned_reach_deepspeeds_pipeline_engine(tmp_path: Path):
    document = tiny_gpt(
        pipeline={"pipeline_parallel_size": 2, "pipe_partitioned": False, "grad_partitioned": True},
        tensor_parallel={"autotp_size": 2},
    )
    config = load(tmp_path, document, world_size=4)
    assert config.deepspeed_config()["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": True}
    # What PipelineEngine.__init__ reads (is_pipe_partitioned, is_grad_partitioned).
    read = get_pipeline_config(config.deepspeed_config())
    assert (read["pipe_partitioned"], read["grad_partitioned"]) == (False, True)


@pytest.mark.parametrize(
    "pipeline, expected",
    [
        ({"pipe_partitioned": "yes"}, "pipeline.pipe_partitioned: expected true or false, got 'yes'"),
        ({"stages": 2}, "pipeline.stages: DeepSpeed's pipeline engine reads no stage count here"),
        ({"partition": "uniform"}, "pipeline.partition: DeepSpeed's pipeline engine ignores it"),
        ({"use_reentrant": True}, "pipeline.use_reentrant: True is not one of false"),
        ({"pipe_partitoned": True}, 'pipeline.pipe_partitoned: unknown key (did you mean "pipe_partitioned"?)'),
    ],
)
def test_what_deepspeeds_pipeline_engine_would_not_do_is_refused_before_launch(
    pipeline: dict, expected: str, tmp_path: Path
):
    document = tiny_gpt(pipeline=pipeline, parallel={"pipeline_parallel_size": 2})
    (issue,) = refusals(tmp_path, document, world_size=2)
    assert issue.startswith(expected), issue


def test_the_3d_example_in_deepspeeds_spellings_validates_at_16_ranks(tmp_path: Path):
    document = {**THREE_D, "model": {**TINY_GPT["model"], "n_layer": 4}, "data": TINY_GPT["data"]}
    config = load(tmp_path, document, world_size=16, hardware=GPU)
    assert config.notices == (
        "tensor_parallel.tp_size is DeepSpeed's spelling of the tensor-parallel degree; read as "
        "parallel.tensor_parallel_size",
        "pipeline.pipeline_parallel_size is DeepSpeed's spelling of the pipeline-stage count; read as "
        "parallel.pipeline_parallel_size",
    )
    assert (
        parallel_layout(config)
        .describe()
        .startswith("rank layout: 4 pipeline stage(s) x 2 data-parallel replica(s) x 2 tensor shard(s)")
    )
    deepspeed_config = config.deepspeed_config()
    assert deepspeed_config["pipeline"] == {"pipe_partitioned": True}
    assert "tensor_parallel" not in deepspeed_config
    assert deepspeed_config["zero_optimization"]["stage"] == 1
    assert (
        deepspeed_config["train_batch_size"],
        deepspeed_config["train_micro_batch_size_per_gpu"],
        deepspeed_config["gradient_accumulation_steps"],
    ) == (512, 256, 1)


# --- optimizer.params.bias_correction: false -------------------------------------------------------


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam_l2"])
def test_the_references_uncorrected_adam_steps_by_the_formula(decoupled: bool):
    lr, (beta1, beta2), eps, decay = 0.01, (0.9, 0.999), 1e-8, 0.1
    torch.manual_seed(0)
    parameter = torch.nn.Parameter(torch.randn(64, dtype=torch.float64))
    optimizer = UncorrectedAdam([{"params": [parameter]}], lr, (beta1, beta2), eps, decay, decoupled)
    expected, m, v = (
        parameter.detach().clone(),
        torch.zeros(64, dtype=torch.float64),
        torch.zeros(64, dtype=torch.float64),
    )
    for _ in range(3):
        grad = torch.randn(64, dtype=torch.float64)
        parameter.grad = grad.clone()
        optimizer.step()
        if not decoupled:
            grad = grad + decay * expected
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        # No division by 1 - beta^t: the first steps move by about lr x (1 - beta1) / sqrt(1 - beta2).
        expected = expected - lr * (m / (v.sqrt() + eps) + (decay * expected if decoupled else 0))
    torch.testing.assert_close(parameter.detach(), expected, rtol=0, atol=1e-15)


def uncorrected(**changes: object) -> dict:
    return tiny_gpt(optimizer={"type": "AdamW", "params": {"lr": 0.001, "bias_correction": False}}, **changes)


@pytest.mark.parametrize(
    "hardware, zero, ops",
    [
        (CPU, {"stage": 0}, ["deepspeed_shm_comm", "fused_adam"]),
        (GPU, {"stage": 1}, ["fused_adam"]),
        (CPU, {"stage": 2, "offload_optimizer": {"device": "cpu"}}, ["deepspeed_shm_comm", "cpu_adam"]),
    ],
    ids=["cpu", "cuda", "offload"],
)
def test_adam_without_bias_correction_runs_deepspeeds_own_adam(
    hardware: Hardware, zero: dict, ops: list, tmp_path: Path
):
    config = load(tmp_path, uncorrected(zero_optimization=zero), world_size=2, hardware=hardware)
    params = config.deepspeed_config()["optimizer"]["params"]
    assert params["bias_correction"] is False and params["torch_adam"] is False and "fused" not in params
    assert ops_needed(config.document, hardware.device_type) == ops


def test_adam_without_bias_correction_is_refused_where_torchs_adam_would_step(tmp_path: Path):
    document = uncorrected()
    document["optimizer"]["params"]["torch_adam"] = True
    (issue,) = refusals(tmp_path, document, world_size=2)
    assert issue.startswith("optimizer.params.bias_correction: false needs DeepSpeed's own Adam")
    accelerate = uncorrected(trainer={**TINY_GPT["trainer"], "backend": "accelerate"})
    (issue,) = refusals(tmp_path, accelerate, world_size=2)
    assert issue.startswith(
        "optimizer.params.bias_correction: false is not supported on the accelerate backend, which steps torch's Adam"
    )
