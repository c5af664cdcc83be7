"""The environment every rank must see, written where DeepSpeed's pdsh route reads it.

Over ssh a rank starts in a fresh login environment: NCCL tuning, thread counts and the engine's
own variables set in the launching shell would silently vanish. DeepSpeed passes on only a few
prefixes (PYTHON*, and NCCL* on CUDA only) plus the lines of `.deepspeed_env` files, so the
launcher writes one file that holds the user's `.deepspeed_env` lines and these variables, and
points DeepSpeed at it with DS_ENV_FILE.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PROPAGATED_PREFIXES = ("NCCL_", "GLOO_", "ENGINE_", "HF_", "TORCH_", "PYTORCH_", "TRANSFORMERS_", "DS_ACCELERATOR")
PROPAGATED_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "CUDA_LAUNCH_BLOCKING")


def user_env_files(home: Path, cwd: Path, environ: Mapping[str, str]) -> list[Path]:
    """The `.deepspeed_env` files DeepSpeed itself would read (home first, then the working directory)."""
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    return [path for path in dict.fromkeys((home / name, cwd / name)) if path.is_file()]


def propagated_environment(environ: Mapping[str, str], files: list[Path]) -> dict[str, str]:
    """Variables for every rank: the propagated ones from `environ`, then the files' lines (files win,
    as in DeepSpeed)."""
    chosen = {
        key: value
        for key, value in environ.items()
        if (key.startswith(PROPAGATED_PREFIXES) or key in PROPAGATED_NAMES) and "\n" not in value
    }
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{path}:{number}: {line!r} is not KEY=VALUE")
            chosen[key.strip()] = value.strip()
    return chosen


def write_env_file(path: Path, variables: Mapping[str, str]) -> None:
    """DeepSpeed's format: one KEY=VALUE per line (it quotes values for the remote shell itself)."""
    path.write_text("".join(f"{key}={value}\n" for key, value in sorted(variables.items())))


def write_launch_env(path: Path) -> dict[str, str]:
    variables = propagated_environment(os.environ, user_env_files(Path.home(), Path.cwd(), os.environ))
    write_env_file(path, variables)
    return variables
