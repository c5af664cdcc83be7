"""Which launcher started this process, and which backend a config runs on because of it.

Users start the same config with `deepspeed`, `accelerate launch` or `torchrun`; each leaves its
own marks in the environment. `trainer.backend: "auto"` follows the launcher, so a run started
by `accelerate launch` trains on the accelerate backend without editing the config, and one started
with accelerate's DeepSpeed plugin (engine/launch/deepspeed_plugin.py) on DeepSpeed.
"""

from __future__ import annotations

import os
from pathlib import Path

# Set by each rank's supervisor to its parent, the launcher, for checks that read the launcher's
# command line (engine/failures/supervise.py).
LAUNCHER_PID_ENV = "ENGINE_LAUNCHER_PID"
# Set by each rank's supervisor to the command the user typed: the `deepspeed` runner above DeepSpeed's
# per-node launcher, else the launcher itself (engine/failures/supervise.py).
TOP_PID_ENV = "ENGINE_TOP_PID"
# Set in the environment of each rank that runs under the supervisor (the supervisor's child).
SUPERVISED_ENV = "ENGINE_SUPERVISED"
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


def deepspeed_plugin_requested() -> bool:
    """Whether `accelerate launch` was given a DeepSpeed plugin (`distributed_type: DEEPSPEED` in its
    yaml, or --use_deepspeed): accelerate then asks for DeepSpeed, not its own DDP or FSDP."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def effective_backend(requested: str, launcher: str | None = None) -> str:
    """The backend `trainer.backend` selects: as written, or for "auto" the launcher's own, which
    for `accelerate launch` with a DeepSpeed plugin is DeepSpeed."""
    if requested in BACKENDS:
        return requested
    if (launcher or detect_launcher()) == "accelerate" and not deepspeed_plugin_requested():
        return "accelerate"
    return "deepspeed"


def _accelerate_command() -> tuple[list[str], Path] | None:
    """The `accelerate launch` command line and its working directory, read from /proc (this
    process's parent for accelerate's single-process launcher, or the supervisor's parent); None
    when the launcher is not accelerate or cannot be read.

    The launcher keeps to itself what ranks cannot see in their environment: the process count it
    was asked for and the yaml it read."""
    launcher = Path("/proc") / os.environ.get(LAUNCHER_PID_ENV, str(os.getppid()))
    try:
        command = (launcher / "cmdline").read_bytes().split(b"\0")
        cwd = (launcher / "cwd").resolve(strict=True)
    except OSError:
        return None
    words = [word.decode(errors="replace") for word in command]
    if not any(word.endswith("accelerate") or "accelerate.commands" in word for word in words):
        return None
    return words, cwd


def launcher_option(name: str) -> str | None:
    """The value `accelerate launch` was given for `--name` (or `--name-spelled-so`, or `--name=value`);
    None when it was not given or the command line cannot be read."""
    command = _accelerate_command()
    if command is None:
        return None
    words = [part for word in command[0] for part in (word.split("=", 1) if word.startswith("--") else [word])]
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for index, word in enumerate(words):
        if word in spellings:
            return words[index + 1] if index + 1 < len(words) else ""
    return None


def accelerate_requested_processes() -> int | None:
    """The process count the `accelerate launch` command line asked for.

    accelerate exits 0 after running ONE process for `--cpu --num_processes 2`; comparing what was
    asked with the world that started is the only way to refuse that instead of training alone.
    """
    value = launcher_option("num_processes")
    return int(value) if value is not None and value.isdigit() else None


def accelerate_config_file() -> Path | None:
    """The yaml `accelerate launch` took its settings from, for messages to name: its --config_file,
    else accelerate's default config file where one exists (which accelerate skips under --cpu);
    None when accelerate did not launch this process, read no yaml, or its command line cannot be read."""
    command = _accelerate_command()
    if command is None:
        return None
    words, cwd = command
    given = launcher_option("config_file")
    if given:
        return (cwd / given).resolve()
    if "--cpu" in words:
        return None
    from accelerate.commands.config import default_config_file

    default = Path(default_config_file)
    return default if default.is_file() else None


_ACCELERATE_PRECISION = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}


def accelerate_precision(precision: str) -> str:
    """accelerate's name for the config's precision ("no" for fp32)."""
    return {"fp32": "no"}.get(precision, precision)


def precision_problem(launcher_precision: str, precision: str, config_path: Path, yaml: Path | None) -> str | None:
    """accelerate's mixed precision against the config's, named where it came from: the
    --mixed_precision flag, or else `yaml`, the file accelerate read.

    "no" is also accelerate's default when neither gives one, so only a requested mixed precision
    can contradict the config."""
    if launcher_precision == "no" or _ACCELERATE_PRECISION.get(launcher_precision) == precision:
        return None
    config_side = f"the config trains in {precision} ({config_path}); precision comes from the config's bf16/fp16 keys"
    if launcher_option("mixed_precision") is not None or yaml is None:
        return (
            f"accelerate launch was given mixed precision {launcher_precision!r} but {config_side}, so drop "
            "--mixed_precision or write the accelerate settings with `python -m engine accelerate-config`"
        )
    wanted = accelerate_precision(precision)
    return f"{yaml} sets mixed_precision {launcher_precision!r} but {config_side}, so set it to {wanted!r} there"


def launch_problems(backend: str, precision: str, world_size: int, config_path: Path) -> list[str]:
    """Ways the launcher's own settings disagree with the config at `config_path` or with the world
    that started (accelerate's DeepSpeed plugin is checked by engine/launch/deepspeed_plugin.py).

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
    launcher_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    problem = precision_problem(launcher_precision, precision, config_path, accelerate_config_file())
    if problem is not None:
        problems.append(problem)
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
        "mixed_precision": accelerate_precision(precision),
        "use_cpu": on_cpu and num_processes == 1,
        "gpu_ids": "all",
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
    }
    prefix = "ACCELERATE_USE_CPU=1 " if on_cpu and num_processes > 1 else ""
    return settings, prefix + "accelerate launch --config_file {file} engine/main.py --deepspeed_config {config}"
