"""`python -m engine validate`, the pre-flight of every launch, imports what checking a config
needs and nothing a run needs: no datasets library, no transformers, no torch.distributed
checkpointing or tensors; DeepSpeed only for its check of the ops the run will build on this
machine, which --no-hardware-check skips and this boot's machine cache answers once warm
(engine/launch/machine_cache.py). With the cache warm it imports no torch either: it answers in less
time than `import torch` takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.launch.hardware import Hardware, detect_hardware
from engine.launch.machine_cache import cache_path, remember
from engine.launch.ops import device_capabilities, known_op_problems, op_problems
from tests.support.launch import ROOT

RUN_ONLY = {"datasets", "transformers", "peft", "torch.distributed.checkpoint", "torch.distributed.tensor"}


def validate_imports(tmp_path: Path, *arguments: str) -> set[str]:
    """The modules a fresh interpreter holds after `python -m engine validate ARGUMENTS` (exit 0)."""
    listing = tmp_path / "modules.json"
    child = (
        "import json, sys\n"
        "from engine.cli import main\n"
        f"code = main(['validate', *{list(arguments)!r}])\n"
        f"json.dump(sorted(sys.modules), open({str(listing)!r}, 'w'))\n"
        "sys.exit(code)\n"
    )
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True, capture_output=True)
    return set(json.loads(listing.read_text()))


@pytest.mark.parametrize("checks", ["with hardware checks", "--no-hardware-check"])
def test_validate_imports_nothing_only_a_run_needs(tmp_path: Path, checks: str):
    arguments = ["configs/zero2.json", *([checks] if checks.startswith("--") else [])]
    modules = validate_imports(tmp_path, *arguments)
    assert sorted(RUN_ONLY & modules) == []
    if checks == "--no-hardware-check":
        assert sorted(name for name in modules if name.split(".")[0] == "deepspeed") == []


def test_a_warm_machine_cache_spares_validate_deepspeed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The first validate of a boot asks DeepSpeed about the ops and stores the clean answer; the next
    one reads it and imports none of DeepSpeed, hardware checks and all."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    validate_imports(tmp_path, "configs/zero2.json")
    assert (tmp_path / "cache" / "dsengine" / "machine.json").is_file()
    modules = validate_imports(tmp_path, "configs/zero2.json")
    assert sorted(name for name in modules if name.split(".")[0] == "deepspeed") == []


# Shipped configs of both decoder families on text and chat data, under DeepSpeed and accelerate.
TORCH_FREE = ("configs/zero2.json", "configs/ddp.json", "configs/llama_tiny.json", "configs/sft_llama_tiny.json")


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a boot whose machine cache is warm: one validate has stored torch's answers."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}
    subprocess.run([sys.executable, "-m", "engine", "validate", TORCH_FREE[0]], cwd=ROOT, env=env, check=True)
    return env


@pytest.mark.parametrize("config", TORCH_FREE)
def test_a_warm_validate_imports_no_torch(config: str, warm_cache: dict[str, str]):
    """`validate` of a config that asks for no LoRA and no NVMe (the checks that build the model on
    the meta device) imports no torch once the machine cache is warm: its import alone takes longer
    than the whole check should, and a launch's pre-flight pays for every import here."""
    child = (
        "import sys\n"
        "from engine.cli import main\n"
        f"code = main(['validate', {config!r}])\n"
        "print(code, sorted(name for name in sys.modules if name.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", child], cwd=ROOT, env=warm_cache, check=True, capture_output=True)
    assert done.stdout.decode().splitlines()[-1] == "0 []"  # after the config's summary and the data's notes


def _forged(cache: Path, change: dict) -> Hardware:
    """Store hardware facts that differ from this machine's under this process's key with `change`
    made to it, and return what detect_hardware then recalls."""
    live = detect_hardware(local_world_size=1)
    remember(
        "hardware",
        {
            "device_type": "cuda",
            "bf16_supported": not live.bf16_supported,
            "fp16_supported": not live.fp16_supported,
            "name": "forged",
        },
    )
    stored = json.loads(cache.read_text())
    stored["key"].update(change)
    cache.write_text(json.dumps(stored))
    return detect_hardware(local_world_size=1, recalled=True)


@pytest.mark.parametrize("change", [{}, {"boot_id": "another boot"}, {"torch": "0.0"}, {"deepspeed": "0.0"}])
def test_machine_facts_are_recalled_only_under_this_boot_and_these_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    recalled = _forged(cache_path(), change)
    if change:
        assert recalled == detect_hardware(local_world_size=1)
    else:  # the control: the file as written is the one read
        assert (recalled.device_type, recalled.name) == ("cuda", "forged")


def test_machine_facts_are_recalled_only_for_the_same_visible_devices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    live = detect_hardware(local_world_size=1)
    remember("hardware", {"device_type": "cuda", "bf16_supported": True, "fp16_supported": True, "name": "forged"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_hardware(local_world_size=1, recalled=True) == live


def test_a_recalled_op_preflight_is_one_of_the_same_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A clean answer stored under one PATH is not the answer under another: there, with no ninja on
    PATH, DeepSpeed's CPU Adam cannot be built, and the live check says so."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ops = ["cpu_adam"]
    assert known_op_problems(ops) == op_problems(ops, device_capabilities())
    monkeypatch.setenv("PATH", str(tmp_path))
    problems = known_op_problems(ops)
    assert problems == op_problems(ops, device_capabilities())
    assert "ninja" in problems[0]
