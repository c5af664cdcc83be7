"""Issue 40: no run-time CUDA build on the default routes. The default optimizer is torch's (fused on a
GPU); a DeepSpeed op a route does need is checked and built before any process group, with an arch
list DeepSpeed's builder parses, and a failure is one message naming the op, the cause and the fix."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

from engine.config import ConfigError, load_config
from engine.describe import describe_run
from engine.launch.hardware import Hardware
from engine.launch.ops import (
    OpBuildError,
    device_capabilities,
    normalized_arch_list,
    op_build_dir,
    op_problems,
    ops_needed,
    preflight_ops,
    toolkit_causes,
)
from engine.preflight import RunError
from tests.support.launch import ROOT

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
GPU = Hardware(
    "cuda", bf16_supported=True, fp16_supported=True, cpu_count=16, local_world_size=8, name="NVIDIA H100 80GB HBM3"
)


@pytest.mark.parametrize(
    ("value", "capabilities", "expected"),
    [
        ("9.0a", [], "9.0"),  # the H100 image of issue 40
        ("10.0a", [], "10.0"),
        ("12.0f", [], "12.0"),
        ("8.0 9.0+PTX", [], "8.0;9.0+PTX"),
        ("8.0;9.0", [], "8.0;9.0"),
        (" 9.0a ; 9.0 ", [], "9.0"),
        (None, [(9, 0), (8, 0), (9, 0)], "8.0;9.0"),  # unset: the visible GPUs, as DeepSpeed probes them
        ("", [(9, 0)], "9.0"),
        (None, [], None),  # unset on a CPU
    ],
)
def test_the_arch_list_is_one_deepspeeds_builder_parses(
    value: str | None, capabilities: list[tuple[int, int]], expected: str | None
):
    assert normalized_arch_list(value, capabilities) == expected


@pytest.mark.parametrize(
    ("value", "raw_fails", "flags"),
    [
        ("9.0a", True, ["-gencode=arch=compute_90,code=sm_90"]),
        ("10.0a", True, ["-gencode=arch=compute_100,code=sm_100"]),
        (
            "8.0 9.0+PTX",
            False,
            [
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90,code=sm_90",
                "-gencode=arch=compute_90,code=compute_90",
            ],
        ),
    ],
)
def test_deepspeeds_builder_fails_on_a_suffix_and_reads_the_normalised_list(
    value: str, raw_fails: bool, flags: list[str], monkeypatch: pytest.MonkeyPatch
):
    """DeepSpeed's own parser (its CUDA FusedAdam builder, which runs it without a GPU), before and
    after: the image's value raises what issue 40's first run died of."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
    if raw_fails:
        with pytest.raises(ValueError, match="invalid literal for int"):
            FusedAdamBuilder().compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", normalized_arch_list(value, []))
    assert FusedAdamBuilder().compute_capability_args() == flags


@pytest.mark.parametrize("value", ["Hopper", "9", "sm_90", "9.0;compute_90", "9.0+ptx"])
def test_an_entry_that_is_no_arch_number_is_refused(value: str):
    with pytest.raises(ValueError, match="is not an architecture number such as 9.0, 9.0a or 9.0\\+PTX"):
        normalized_arch_list(value, [(9, 0)])


def resolved(config: str, overrides: list[str], hardware: Hardware, world_size: int = 2) -> dict:
    return load_config(ROOT / "configs" / config, overrides, world_size=world_size, hardware=hardware).document


def test_the_default_gpu_route_builds_nothing_and_steps_with_torchs_fused_adamw():
    for config in ("zero2.json", "zero3.json", "pipeline2.json", "ddp.json", "fsdp_full.json"):
        document = resolved(config, [], GPU)
        assert document["optimizer"]["params"]["fused"] is True, config
        assert ops_needed(document, "cuda") == [], config
        assert document["optimizer"]["params"]["torch_adam"] is True, config


def test_optimizer_offload_builds_deepspeeds_cpu_adam_unless_torch_adam_is_asked_for():
    for hardware in (GPU, CPU):
        document = resolved("zero2_offload.json", [], hardware)
        assert document["optimizer"]["params"]["torch_adam"] is False
        assert document["optimizer"]["params"]["fused"] is False
        assert ops_needed(document, hardware.device_type)[-1:] == ["cpu_adam"]
    document = resolved("zero3_offload.json", ["optimizer.params.torch_adam=true"], GPU)
    assert ops_needed(document, "cuda") == []
    assert document["optimizer"]["params"]["fused"] is False  # the masters are on the host


def test_fused_adam_is_built_only_where_the_config_asks_for_it_by_name():
    config = load_config(
        ROOT / "configs" / "zero2.json", ["optimizer.params.torch_adam=false"], world_size=2, hardware=GPU
    )
    document = config.document
    assert document["optimizer"]["params"]["fused"] is False  # resolved_config.json holds what ran
    assert "fused" not in config.deepspeed_config()["optimizer"]["params"]  # FusedAdam takes no such argument
    assert ops_needed(document, "cuda") == ["fused_adam"]
    document = resolved("zero2.json", ["optimizer.legacy_fusion=true"], GPU)  # read by FusedAdam's wrapper only
    assert ops_needed(document, "cuda") == ["fused_adam"]
    with pytest.raises(ConfigError, match="optimizer.params.fused: true asks for torch's fused Adam"):
        resolved("zero2.json", ["optimizer.params.torch_adam=false", "optimizer.params.fused=true"], GPU)


def test_the_accelerate_backend_fuses_only_where_nothing_is_offloaded():
    assert resolved("ddp.json", [], GPU)["optimizer"]["params"]["fused"] is True
    assert resolved("fsdp_offload.json", [], GPU)["optimizer"]["params"]["fused"] is False
    assert ops_needed(resolved("fsdp_offload.json", [], GPU), "cuda") == []


def test_a_cpu_run_builds_deepspeeds_communication_op_and_the_writer_builds_async_io():
    """init_distributed builds DeepSpeed's shared-memory op on a CPU; FastPersist writes through async_io."""
    document = resolved("zero2.json", [], CPU)
    assert document["optimizer"]["params"]["fused"] is False
    assert ops_needed(document, "cpu") == ["deepspeed_shm_comm"]
    document["checkpoint"] = {"writer": {"type": "fast"}}
    assert ops_needed(document, "cuda") == ["async_io"]
    document["checkpoint"] = {"writer": {"type": "PYTHON"}}
    assert ops_needed(document, "cuda") == []


def without_compilers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A node with no C++ compiler and no ninja, and no op built yet."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))


def test_a_missing_compiler_is_one_message_naming_the_op_the_cause_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    without_compilers(monkeypatch, tmp_path)
    [problem] = op_problems(["cpu_adam"], [])
    assert problem == (
        "DeepSpeed op cpu_adam cannot be built on this node: no C++ compiler ('c++' is not on PATH); ninja, which "
        "torch builds with, is not on PATH. Fix: install one (apt-get install g++) or set CXX to one; or pip install "
        "ninja; or set optimizer.params.torch_adam=true (torch's AdamW steps the offloaded fp32 masters)"
    )
    with pytest.raises(OpBuildError) as refused:
        preflight_ops(["deepspeed_shm_comm", "cpu_adam"], [])
    lines = str(refused.value).splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "DeepSpeed op deepspeed_shm_comm cannot be built on this node",
        "DeepSpeed op cpu_adam cannot be built on this node",
    ]


def test_prepare_refuses_a_run_whose_op_cannot_be_built_before_any_process_group(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("WORLD_SIZE", "1")
    overrides = [
        "zero_optimization.stage=2",
        "zero_optimization.offload_optimizer.device=cpu",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    without_compilers(monkeypatch, tmp_path)
    with pytest.raises(RunError, match=r"DeepSpeed op cpu_adam cannot be built on this node: no C\+\+ compiler"):
        describe_run(str(ROOT / "configs" / "tiny_gpt.json"), overrides)


def test_no_cuda_compiler_is_named_with_its_fix(tmp_path: Path):
    [(cause, fix)] = toolkit_causes(None)
    assert cause.startswith("no CUDA compiler: torch finds no CUDA_HOME") and "CUDA toolkit" in fix
    [(cause, _)] = toolkit_causes(str(tmp_path))
    assert cause == f"no CUDA compiler: CUDA_HOME {tmp_path} has no bin/nvcc (a runtime-only install?)"
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    assert toolkit_causes(str(tmp_path)) == []


def test_cpu_adam_builds_once_then_loads_from_torchs_cache():
    """A real build on a fresh machine (about 90 s), a load from the cache after."""
    said: list[str] = []
    preflight_ops(["cpu_adam"], [], said.append)
    assert all(line.startswith("building DeepSpeed op cpu_adam once for this node") for line in said), said
    assert any(op_build_dir("cpu_adam").glob("*.so"))
    said.clear()
    preflight_ops(["cpu_adam"], [], said.append)
    assert said == []
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))]).step()


def test_a_rank_waits_for_the_one_building_and_a_stale_torch_lock_is_cleared():
    folder = op_build_dir("cpu_adam")
    stale = folder / "lock"  # what torch's baton leaves when a build is killed
    stale.touch()
    said: list[str] = []
    with open(folder.with_name("cpu_adam.lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write("pid 1 on builder-host")
        lock.flush()
        waiting = threading.Thread(target=preflight_ops, args=(["cpu_adam"], [], said.append))
        waiting.start()
        deadline = time.monotonic() + 60  # the thread imports DeepSpeed's builder first: slow on a busy machine
        while not said and time.monotonic() < deadline:
            time.sleep(0.05)
        assert waiting.is_alive() and said == ["waiting for pid 1 on builder-host to build DeepSpeed op cpu_adam"]
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiting.join()
    assert not stale.exists()
    assert said[1] == f"removing {stale}, left by a build of DeepSpeed op cpu_adam that did not finish"


@pytest.mark.gpu
def test_on_a_gpu_a_suffixed_arch_list_builds_fused_adam(monkeypatch: pytest.MonkeyPatch):
    """What issue 40's first run asked for (FusedAdam under TORCH_CUDA_ARCH_LIST=9.0a), built through the
    pre-flight; the image's value is back in the environment after."""
    capabilities = device_capabilities()
    suffixed = ";".join(f"{major}.{minor}a" for major, minor in sorted(set(capabilities)))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopper")
    [problem] = op_problems(["fused_adam"], capabilities)
    assert problem.startswith("DeepSpeed op fused_adam cannot be built on this node: TORCH_CUDA_ARCH_LIST entry")
    assert f"TORCH_CUDA_ARCH_LIST={normalized_arch_list(None, capabilities)}" in problem
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", suffixed)
    preflight_ops(["fused_adam"], capabilities)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == suffixed
    from deepspeed.ops.adam import FusedAdam

    parameter = torch.nn.Parameter(torch.ones(8, device="cuda"))
    parameter.grad = torch.ones_like(parameter)
    FusedAdam([parameter], lr=0.1).step()
    assert torch.all(parameter < 1)
