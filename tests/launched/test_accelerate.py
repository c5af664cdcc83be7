"""The accelerate backend, launched for real with `accelerate launch` (2 CPU processes, gloo):
DDP and torch FSDP2 from the same JSON config train the same numbers as the single-process
reference (which the DeepSpeed backend matches too: tests/launched/test_parity.py), FSDP really shards,
resume is exact, and the launcher's own settings cannot contradict the config. A DeepSpeed-plugin
yaml (`distributed_type: DEEPSPEED`) trains on the DeepSpeed backend as the `deepspeed` launcher does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from models import get_family
from tests.support.compare import (
    LOSS_TOLERANCE,
    UNCLIPPED_WEIGHT_TOLERANCE,
    assert_eval_matches,
    assert_grad_norms_match,
    assert_weights_match,
    max_loss_difference,
)
from tests.support.launch import ROOT, Run, free_port, launch_accelerate, run_launcher, run_to_end
from tests.support.memory import assert_plan_matches_measured
from tests.support.monitor import MONITORS, assert_monitor_holds
from tests.support.reference import reference_run
from tests.support.shared_runs import Trained

CONFIGS = {"gpt": "configs/tiny_gpt.json", "llama": "configs/llama_tiny.json", "resnet": "configs/tiny_resnet.json"}
# ResNet trains unclipped, as in test_parity.py: FSDP's norm summed from shards is 2.3e-6 off the
# reference's at step 1, and BatchNorm over micro-batches of 4 grows that to a loss 1.4e-4 off by
# step 5 (measured on an AMD EPYC; an Intel machine stayed under 1e-5). Unclipped, FSDP is
# bit-identical; clipping under FSDP is checked on GPT.
FAMILY_OVERRIDES = {"gpt": {}, "llama": {}, "resnet": {"gradient_clipping": 0.0}}
# FSDP sums the clipping norm from shards, so clip coefficients differ in the last bit; Adam turns
# that into visible steps for elements whose gradient is near eps (see test_parity.py).
WEIGHT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Wrapper:
    name: str
    overrides: dict
    wrapper: str  # what the run must report wrapping the model in

    @property
    def sharded(self) -> bool:
        return self.wrapper != "ddp"


# Accumulation runs 2 micro-batches per step, the first without gradient synchronisation.
WRAPPERS = [
    Wrapper("ddp", {"zero_optimization.stage": 0}, "ddp"),
    Wrapper("ddp_accumulate", {"zero_optimization.stage": 0, "gradient_accumulation_steps": 2}, "ddp"),
    Wrapper("fsdp_grad_op", {"zero_optimization.stage": 2}, "fsdp_grad_op"),
    Wrapper("fsdp_full", {"zero_optimization.stage": 3}, "fsdp_full"),
    Wrapper("fsdp_full_accumulate", {"zero_optimization.stage": 3, "gradient_accumulation_steps": 2}, "fsdp_full"),
    Wrapper(
        "fsdp_offload", {"zero_optimization.stage": 3, "zero_optimization.offload_param.device": "cpu"}, "fsdp_full"
    ),
]


def parameter_elements_per_rank(stdout: str) -> tuple[list[int], int]:
    match = re.search(r"parameter elements per rank: \[([\d, ]+)\] of (\d+)", stdout)
    assert match, stdout[-3000:]
    return [int(count) for count in match.group(1).split(",")], int(match.group(2))


# ResNet runs the wrappers whose arithmetic differs (BatchNorm per rank, gradients sharded, micro-batch
# gradients summed before the reduction; unclipped, measured 1.8e-7 from the reference under FSDP
# with accumulation); Llama the one that shards its decoder layers, grouped-query attention and
# untied head; GPT runs them all.
FAMILY_WRAPPERS = {"llama": ("fsdp_full",), "resnet": ("ddp", "fsdp_full", "fsdp_full_accumulate")}
# GPT under DDP is launched from the config file `engine accelerate-config` writes, and held to the
# reference there (test_written_accelerate_config_file_launches_the_run).
FROM_CONFIG_FILE = ("gpt", "ddp")
CASES = [
    (family, wrapper)
    for family in sorted(CONFIGS)
    for wrapper in WRAPPERS
    if (family == "gpt" or wrapper.name in FAMILY_WRAPPERS[family]) and (family, wrapper.name) != FROM_CONFIG_FILE
]
# Rows whose run the resume and reshape tests continue (tests/support/shared_runs.py): the same
# wrapper, trained once, for six steps under a warm-up schedule with a checkpoint at step 3.
SHARED = {("gpt", "fsdp_full"): "gpt_fsdp", ("resnet", "fsdp_full"): "resnet_fsdp"}


@pytest.mark.launch
@pytest.mark.parametrize("family,wrapper", CASES, ids=[f"{family}-{wrapper.name}" for family, wrapper in CASES])
def test_accelerate_matches_single_process_and_shards(
    family: str, wrapper: Wrapper, trained: Callable[[str], Trained], tmp_path: Path
):
    if (family, wrapper.name) in SHARED:
        shared = trained(SHARED[family, wrapper.name])
        run, overrides = shared.run, shared.overrides
        assert overrides.items() >= {**wrapper.overrides, **FAMILY_OVERRIDES[family]}.items()
    else:
        overrides = {**wrapper.overrides, **FAMILY_OVERRIDES[family]}
        run = launch_accelerate(CONFIGS[family], overrides, tmp_path / "run")
    assert_matches_reference_and_shards(run, family, wrapper, overrides)


def assert_matches_reference_and_shards(run: Run, family: str, wrapper: Wrapper, overrides: dict) -> None:
    """The single-process reference's losses, gradient norms, weights and evaluation; the wrapper the
    run reports, each rank's share of the parameters, and the plan's bytes per rank."""
    overrides = {**overrides, "trainer.backend": "accelerate"}
    reference = reference_run(CONFIGS[family], overrides, world_size=2)
    assert len(run.losses) == len(reference.losses)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    assert_weights_match(run.exported_state_dict(), reference.model, WEIGHT_TOLERANCE)
    if family != "resnet":
        assert_eval_matches(run.records, reference.eval_loss, LOSS_TOLERANCE)
    assert f"accelerate backend: {wrapper.wrapper} on 2 process(es)" in run.stdout
    per_rank, total = parameter_elements_per_rank(run.stdout)
    if wrapper.sharded:
        # Each parameter is split in two along its first dimension; odd sizes round one way.
        assert sum(per_rank) == total
        assert all(abs(count - total / 2) <= total * 0.01 for count in per_rank), per_rank
    else:
        assert per_rank == [total, total]
    # The tiny GPT's vocabulary has an odd number of rows: under FSDP the ranks hold different optimizer bytes.
    assert_plan_matches_measured(run, CONFIGS[family], overrides, world_size=2)


@pytest.mark.launch
def test_accelerate_fsdp_resume_continues_exactly(trained: Callable[[str], Trained], tmp_path: Path):
    """FSDP (fully sharded) on 2 ranks resumed on its own layout from the step-3 checkpoint of the
    uninterrupted run: the steps after it, the learning rates of its warm-up and the final weights,
    bit for bit."""
    fsdp = trained("gpt_fsdp")
    straight = fsdp.run
    checkpoint = straight.output_dir / "checkpoints" / "step00000003"
    resumed = fsdp.launch_again({**fsdp.overrides, "trainer.resume": str(checkpoint)}, tmp_path / "resumed")
    assert [record["step"] for record in resumed.records] == [4, 5, 6]
    assert resumed.losses == straight.losses[3:]
    assert [record["lr"] for record in resumed.records] == [record["lr"] for record in straight.records[3:]]
    final, expected = resumed.exported_state_dict(), straight.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name
    exported = get_family("gpt").load_export(resumed.output_dir / "export")
    assert torch.equal(exported.transformer.wte.weight, final["transformer.wte.weight"])


@pytest.mark.launch
def test_compiled_fsdp_trains_as_the_eager_reference(tmp_path: Path):
    """`trainer.compile` on the accelerate backend compiles block by block before FSDP2 wraps them:
    the eager single-process reference's losses, gradient norms and weights, to inductor's rounding
    (measured on the CI machine: losses bit-identical; the two blocks share one graph, recompiled
    only for evaluation's no_grad)."""
    overrides = {"zero_optimization.stage": 3, "trainer.compile": True}
    run = launch_accelerate(CONFIGS["gpt"], overrides, tmp_path / "run")
    reference = reference_run(CONFIGS["gpt"], {**overrides, "trainer.backend": "accelerate"}, world_size=2)
    assert "compiled (torch.compile)" in run.stdout
    assert max_loss_difference(run.losses, reference.losses) <= 1e-4, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms, rtol=1e-3)
    assert_weights_match(run.exported_state_dict(), reference.model, WEIGHT_TOLERANCE)


@pytest.mark.launch
def test_bf16_fsdp_trains_as_the_autocast_reference_and_exports_fp32_weights(tmp_path: Path):
    """The accelerate backend's bf16 is torch.autocast around fp32 weights: FSDP on 2 ranks trains
    what one process trains under autocast, and measurably not what it trains in fp32. Unclipped:
    FSDP's clip coefficient, summed from shards, is one bit off torch's, which under autocast flips
    bf16 roundings (test_parity.py)."""
    overrides = {"zero_optimization.stage": 3, "bf16.enabled": True, "gradient_clipping": 0.0}
    run = launch_accelerate(CONFIGS["gpt"], overrides, tmp_path / "run")
    # The reference's autocast is spelled as the DeepSpeed backend spells it (torch_autocast).
    fp32_overrides = {**overrides, "bf16.enabled": False}
    reference = reference_run(CONFIGS["gpt"], {**fp32_overrides, "torch_autocast.enabled": True}, world_size=2)
    fp32 = reference_run(CONFIGS["gpt"], fp32_overrides, world_size=2)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    exported = run.exported_state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in exported.values())
    assert_weights_match(exported, reference.model, UNCLIPPED_WEIGHT_TOLERANCE)
    assert_eval_matches(run.records, reference.eval_loss, LOSS_TOLERANCE)
    with pytest.raises(AssertionError):
        assert_weights_match(exported, fp32.model, 10 * UNCLIPPED_WEIGHT_TOLERANCE)
    # The gradients and Adam's moments are fp32 too: the plan's fp32 bytes are what each rank holds.
    assert_plan_matches_measured(run, CONFIGS["gpt"], {**overrides, "trainer.backend": "accelerate"}, world_size=2)


@pytest.mark.launch
def test_written_accelerate_config_file_launches_the_run(tmp_path: Path):
    config_file = tmp_path / "accelerate.yaml"
    command = [sys.executable, "-m", "engine", "accelerate-config", CONFIGS["gpt"], "--output", str(config_file)]
    written = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert written.returncode == 0, written.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --config_file" in written.stdout
    ddp = WRAPPERS[0]
    overrides = {**ddp.overrides, **MONITORS}
    run = launch_accelerate(CONFIGS["gpt"], overrides, tmp_path / "run", config_file=config_file)
    assert_matches_reference_and_shards(run, "gpt", ddp, overrides)
    # Without a DeepSpeed engine the sink builds DeepSpeed's monitor itself, from the same keys.
    for key in ("loss", "lr", "eval_loss"):
        assert_monitor_holds(run.output_dir, key)


def _accelerate(arguments: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = ["accelerate", "launch", *arguments, "engine/main.py", "--deepspeed_config", CONFIGS["gpt"]]
    command.append(f"--set=trainer.output_dir={tmp_path}")
    return run_to_end(command, env={**os.environ, **env}, timeout=300)


@pytest.mark.launch
def test_launcher_settings_contradicting_the_config_are_refused(tmp_path: Path):
    """accelerate's --cpu flag runs one process where --num_processes asked for 2, and --mixed_precision
    bf16 contradicts a config that trains in fp32: the run reports both at once and trains nothing."""
    result = _accelerate(["--cpu", "--num_processes", "2", "--mixed_precision", "bf16"], tmp_path, {})
    assert result.returncode != 0
    assert "accelerate launch asked for 2 processes but started a world of 1" in result.stderr, result.stderr[-4000:]
    message = "accelerate launch was given mixed precision 'bf16' but the config trains in fp32"
    assert message in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "metrics.jsonl").exists()


# What the accelerate backend cannot honour, each key's problem: one `validate` reports them all at once.
CANNOT = {
    "zero_optimization.stage": (1, "zero_optimization.stage: FSDP has no optimizer-only sharding"),
    "parallel.pipeline_parallel_size": (2, "parallel.pipeline_parallel_size: pipeline and tensor parallelism"),
    "fp16.enabled": (True, "fp16.enabled: the accelerate backend trains in fp32 or bf16"),
}


def test_what_the_accelerate_backend_cannot_do_is_refused():
    overrides = {**{key: value for key, (value, _) in CANNOT.items()}, "trainer.backend": "accelerate"}
    sets = [f"--set={key}={str(value).lower()}" for key, value in overrides.items()]
    command = [sys.executable, "-m", "engine", "validate", CONFIGS["gpt"], "--world-size", "2", "--no-hardware-check"]
    result = subprocess.run([*command, *sets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"({len(CANNOT)} problems)" in result.stderr, result.stderr[-3000:]
    for _, expected in CANNOT.values():
        assert expected in result.stderr


def zero2_config(directory: Path) -> Path:
    """configs/tiny_gpt.json under ZeRO-2, written where a yaml can name it. One thread per rank:
    `accelerate launch` sets OMP_NUM_THREADS=1 and the deepspeed launcher does not, and matrix
    products summed over other thread counts round differently."""
    document = json.loads((ROOT / CONFIGS["gpt"]).read_text())
    document["zero_optimization"]["stage"] = 2
    document["trainer"]["threads_per_rank"] = 1
    path = directory / "zero2.json"
    path.write_text(json.dumps(document, indent=2))
    return path


def deepspeed_plugin_yaml(directory: Path, deepspeed_config_file: Path, zero_stage: int) -> Path:
    """The yaml `accelerate config` writes for 2 processes with a DeepSpeed plugin."""
    settings = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": str(deepspeed_config_file),
            "zero_stage": zero_stage,
            "offload_optimizer_device": "none",
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "zero3_init_flag": False,
        },
        "mixed_precision": "no",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": 2,
        "rdzv_backend": "static",
        "same_network": True,
    }
    path = directory / "ds.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


@pytest.mark.launch
def test_a_deepspeed_plugin_yaml_trains_on_deepspeed_as_the_deepspeed_launcher_does(
    trained: Callable[[str], Trained], tmp_path: Path
):
    """The same run as the deepspeed launcher's ZeRO-2 run of tests/support/shared_runs.py, loss for loss."""
    deepspeed = trained("gpt_zero2")
    config = zero2_config(tmp_path)
    config_file = deepspeed_plugin_yaml(tmp_path, config, zero_stage=2)
    run = launch_accelerate(str(config), deepspeed.overrides, tmp_path / "accelerate", config_file=config_file)
    resolved = json.loads((run.output_dir / "resolved_config.json").read_text())
    assert resolved["trainer"]["backend"] == "deepspeed" and resolved["zero_optimization"]["stage"] == 2
    assert "on 2 rank(s), deepspeed backend, ZeRO stage 2" in run.stdout, run.stdout[-3000:]
    assert len(run.losses) == deepspeed.overrides["trainer.max_steps"]
    assert run.losses == deepspeed.run.losses


@pytest.mark.launch
def test_a_deepspeed_plugin_yaml_contradicting_the_config_is_refused_before_any_process_group(tmp_path: Path):
    config = zero2_config(tmp_path)
    config_file = deepspeed_plugin_yaml(tmp_path, config, zero_stage=3)
    launcher = ["accelerate", "launch", "--config_file", str(config_file), "--main_process_port", str(free_port())]
    result = run_launcher(launcher, str(config), {}, tmp_path / "run", {})
    assert result.returncode != 0
    message = f"{config_file.resolve()} sets zero_stage 3 but {config.resolve()} has zero_optimization.stage 2"
    assert message in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "run" / "logs").exists()  # each rank's log starts with its process group
