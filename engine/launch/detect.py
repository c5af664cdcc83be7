"""Which launcher started this process, and which backend a config runs on because of it.

Users start the same config with `deepspeed`, `accelerate launch` or `torchrun`; each leaves its
own marks in the environment. `trainer.backend: "auto"` follows the launcher, so a run started
by `accelerate launch` trains on the accelerate backend without editing the config.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# Set by each rank's supervisor to its parent, the launcher, for checks that read the launcher's
# command line (engine/failures/supervise.py).
LAUNCHER_PID_ENV = "ENGINE_LAUNCHER_PID"
BACKENDS = ("deepspeed", "accelerate")


def detect_launcher() -> str:
    """ "accelerate", "deepspeed", "torchrun" or "none" (a plain `python` process)."""
    env = os.environ
    if "ACCELERATE_MIXED_PRECISION" in env or "ACCELERATE_DYNAMO_BACKEND" in env:
        return "accelerate"
    if "LOCAL_SIZE" in env or "CROSS_RANK" in env:
        return "deepspeed"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    return "none"


def effective_backend(requested: str, launcher: str | None = None) -> str:
    """The backend `trainer.backend` selects: as written, or for "auto" the launcher's own."""
    if requested in BACKENDS:
        return requested
    return "accelerate" if (launcher or detect_launcher()) == "accelerate" else "deepspeed"


def accelerate_requested_processes() -> int | None:
    """The process count the `accelerate launch` command line asked for, read from the launcher's
    own command line (this process's parent for accelerate's single-process launcher, or the
    supervisor's parent).

    accelerate exits 0 after running ONE process for `--cpu --num_processes 2`; comparing what was
    asked with the world that started is the only way to refuse that instead of training alone.
    """
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV, str(os.getppid()))
    try:
        command = (Path("/proc") / launcher_pid / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [word.decode(errors="replace") for word in command]
    if not any(word.endswith("accelerate") or "accelerate.commands" in word for word in words):
        return None
    for index, word in enumerate(words):
        match = re.fullmatch(r"--num[_-]processes(?:=(\d+))?", word)
        if match:
            value = match.group(1) or (words[index + 1] if index + 1 < len(words) else "")
            return int(value) if value.isdigit() else None
    return None


_ACCELERATE_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def launch_problems(backend: str, precision: str, world_size: int) -> list[str]:
    """Ways the launcher's own settings disagree with the config or with the world that started.

    The JSON config is the one source of truth, so `accelerate launch` flags that would change the
    run behind its back are refused, as is accelerate's degraded CPU mode (one process instead
    of the N asked for).
    """
    problems = []
    requested = accelerate_requested_processes()
    if requested is not None and requested != world_size:
        problems.append(
            f"accelerate launch asked for {requested} processes but started a world of {world_size}; on CPU "
            f"accelerate needs ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {requested} "
            "(its --cpu flag runs one process)"
        )
    if backend != "accelerate" or detect_launcher() != "accelerate":
        return problems
    # "no" is also accelerate's default when the flag is absent, so only a requested mixed precision
    # can contradict the config.
    launcher_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launcher_precision != "no" and _ACCELERATE_PRECISION.get(launcher_precision) != precision:
        problems.append(
            f"accelerate launch was given mixed precision {launcher_precision!r} but the config trains in "
            f"{precision}; precision comes from the config's bf16/fp16 keys, so drop --mixed_precision or write "
            "the accelerate settings with `python -m engine accelerate-config`"
        )
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        problems.append(
            "accelerate launch was given --use_fsdp; FSDP comes from the config's zero_optimization.stage "
            "(2: FSDP keeping parameters gathered from forward to backward, 3: resharding them after forward), "
            "so drop the flag"
        )
    return problems


def accelerate_settings(precision: str, num_processes: int, on_cpu: bool) -> tuple[dict, str]:
    """The accelerate config file a run needs, written from the JSON config, and the command that
    launches with it.

    MULTI_GPU on CPU too: with ACCELERATE_USE_CPU=1 it starts `num_processes` ranks of one gloo
    world, where a MULTI_CPU file starts independent single-process worlds.
    """
    settings = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if num_processes > 1 else "NO",
        "num_machines": 1,
        "machine_rank": 0,
        "num_processes": num_processes,
        "mixed_precision": {"fp32": "no"}.get(precision, precision),
        "use_cpu": on_cpu and num_processes == 1,
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
    }
    prefix = "ACCELERATE_USE_CPU=1 " if on_cpu and num_processes > 1 else ""
    return settings, prefix + "accelerate launch --config_file {file} engine/main.py --deepspeed_config {config}"
