"""DeepSpeed C++/CUDA ops a run needs, checked and built before any process group.

DeepSpeed builds an op the first time something asks for it (FusedAdam's and DeepSpeedCPUAdam's
constructors, its CPU communication backend, its NVMe swapper): inside `deepspeed.initialize` or
`init_distributed`, after every process group has started, on every rank at once, and a failure
there is a traceback per rank. The first GPU run of issue 40 died that way, at FusedAdam's build:
the image's TORCH_CUDA_ARCH_LIST=9.0a, which torch reads, is one DeepSpeed's builder cannot parse.

Here `describe_run` lists the ops the resolved config needs, checks that each can be built on this node
(a compiler, ninja, an arch list DeepSpeed parses) and loads it, so a problem is one message naming
the op, the cause and the fix, before anything starts. torch caches each build under its extensions
folder (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions); the first rank of a node to take the
op's `flock` builds it and the others wait, as the token cache is built (data/tokens/cache.py).
DeepSpeed's own request later in the same process finds the op loaded.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.launch.machine_cache import recall, remember

_ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"
# An entry torch accepts as a number: major.minor, an architecture-specific suffix (9.0a, 12.0f), +PTX.
_ARCH_ENTRY = re.compile(r"(\d+)\.(\d+)[a-z]?(\+PTX)?")
# What else the pre-flight reads of the environment: where compilers and ninja are found, the
# compiler, torch's extension folder and CUDA install, the arch list, DeepSpeed's accelerator.
_PREFLIGHT_ENV = ("PATH", "CXX", "TORCH_EXTENSIONS_DIR", "CUDA_HOME", "CUDA_PATH", _ARCH_LIST_ENV, "DS_ACCELERATOR")
_ERROR_LINES = 8  # of a failed build's output: the compiler's last words, where the cause is


@dataclass(frozen=True)
class _Op:
    builder: str  # DeepSpeed's builder class (deepspeed/ops/op_builder/), as its accelerator names it
    avoid: str  # the config change that needs no build ("" where there is none)
    optional: bool = False  # DeepSpeed does without it where its builder is not compatible
    needs: str = ""  # what to install where DeepSpeed's compatibility check fails


OPS: dict[str, _Op] = {
    "cpu_adam": _Op(
        "CPUAdamBuilder", "set optimizer.params.torch_adam=true (torch's AdamW steps the offloaded fp32 masters)"
    ),
    "fused_adam": _Op(
        "FusedAdamBuilder", "set optimizer.params.torch_adam=true (torch's fused AdamW, the same update)"
    ),
    "async_io": _Op(
        "AsyncIOBuilder",
        'set zero_optimization.offload_*.device to "cpu" and drop checkpoint.writer (NVMe offload and FastPersist '
        "write through async_io)",
        needs="install libaio with its headers (apt-get install libaio-dev, dnf install libaio-devel)",
    ),
    "quantizer": _Op("QuantizerBuilder", "turn zero_optimization.zero_quantized_* off"),
    # DeepSpeed's CPU communication backend, built in init_distributed where its builder is compatible.
    "deepspeed_shm_comm": _Op("ShareMemCommBuilder", "", optional=True),
}


class OpBuildError(ValueError):
    """A DeepSpeed op this run needs cannot be built here (a ValueError: `describe_run` reports it as it
    reports every input problem, one message and exit code 2)."""


def ops_needed(document: Mapping[str, Any], device_type: str) -> list[str]:
    """The DeepSpeed ops a resolved config's run builds on `device_type` ("cuda" or "cpu"), as DeepSpeed
    picks them: its CPU Adam under optimizer offload (`zero_use_cpu_optimizer`: to cpu or nvme) and
    FusedAdam elsewhere, unless torch_adam steps with torch's Adam; async_io for NVMe and the FastPersist
    checkpoint writer; the quantizer for ZeRO++; and on a CPU its shared-memory communication op. The
    accelerate backend builds torch's optimizers only (engine/backends/optim.py)."""
    ops = ["deepspeed_shm_comm"] if device_type == "cpu" else []
    if document["trainer"]["backend"] != "deepspeed":
        return ops
    optimizer, zero = document["optimizer"], document["zero_optimization"]
    offload = zero["offload_optimizer"]["device"]
    if optimizer["type"] in ("Adam", "AdamW") and optimizer["params"].get("torch_adam") is not True:
        ops.append("cpu_adam" if offload != "none" else "fused_adam")
    writer = document.get("checkpoint", {}).get("writer")
    fast_writer = isinstance(writer, dict) and str(writer.get("type", "fast")).upper() == "FAST"
    if "nvme" in (offload, zero["offload_param"]["device"]) or fast_writer:
        ops.append("async_io")
    quantized = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
    if zero["stage"] == 3 and any(zero.get(key) for key in quantized):
        ops.append("quantizer")
    return ops


def normalized_arch_list(value: str | None, device_capabilities: list[tuple[int, int]]) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's builder parses it: `;`-separated `major.minor` entries, `+PTX`
    kept. torch reads architecture-specific suffixes (`9.0a`, `10.0a`, `12.0f`) and CUDA images set
    them; DeepSpeed's builder sorts the entries by `int()` of each part and fails on "0a". Its ops use
    nothing that needs the suffix (code built for 9.0 runs on every 9.0 device), so the suffix is
    dropped. `;` and whitespace both separate entries. Unset or blank: the visible devices'
    capabilities, as DeepSpeed itself would probe them; None where there are none (a CPU).

    Raises ValueError for an entry that is no architecture number (torch's names, such as "Hopper")."""
    if value is None or not value.strip():
        found = sorted(set(device_capabilities))
        return ";".join(f"{major}.{minor}" for major, minor in found) or None
    entries: list[str] = []
    for entry in value.replace(";", " ").split():
        match = _ARCH_ENTRY.fullmatch(entry)
        if match is None:
            raise ValueError(
                f"{_ARCH_LIST_ENV} entry {entry!r} is not an architecture number such as 9.0, 9.0a or 9.0+PTX"
            )
        number = f"{match[1]}.{match[2]}{match[3] or ''}"
        if number not in entries:
            entries.append(number)
    return ";".join(entries)


def device_capabilities() -> list[tuple[int, int]]:
    """The compute capabilities of the GPUs this process sees (none on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(index) for index in range(torch.cuda.device_count())]


def op_build_dir(name: str) -> Path:
    """Where torch builds and caches the op `name`: TORCH_EXTENSIONS_DIR/name, else
    ~/.cache/torch_extensions/<python>_<cuda>/name (torch's own rule, created if missing)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def op_problems(ops: list[str], capabilities: list[tuple[int, int]]) -> list[str]:
    """One message per op of `ops` that cannot be built (or loaded) on this node, building nothing:
    what `python -m engine validate` reports, and what the pre-flight refuses before it builds."""
    return _problems(_to_load(ops), capabilities)


def known_op_problems(ops: list[str]) -> list[str]:
    """`op_problems` on this machine's GPUs, without importing torch or DeepSpeed where a process of
    this boot found the same ops buildable in the same environment (engine/launch/machine_cache.py).
    Only that clean answer is stored: every problem is the live check's own, found again each time."""
    if recall("ops", _preflight_setting(ops)) is not None:
        return []
    problems = op_problems(ops, device_capabilities())
    if not problems:
        remember("ops", True, _preflight_setting(ops))
    return problems


def _preflight_setting(ops: list[str]) -> dict[str, Any]:
    return {"ops": sorted(ops), **{name: os.environ.get(name) for name in _PREFLIGHT_ENV}}


def preflight_ops(ops: list[str], capabilities: list[tuple[int, int]], announce: Callable[[str], None] = print) -> None:
    """Check that every op of `ops` can be built here (all problems at once), then build or load each in
    this process, one build per node. Raises OpBuildError naming the op, the cause and the fix."""
    to_load = _to_load(ops)
    problems = _problems(to_load, capabilities)
    if problems:
        raise OpBuildError("\n".join(problems))
    remember("ops", True, _preflight_setting(ops))
    for name, builder in to_load:
        if _prebuilt(builder):
            builder.load(verbose=False)
        else:
            _build(name, builder, _arch_list(builder, capabilities), announce)


def prepare_ops(document: Mapping[str, Any], device_type: str, announce: Callable[[str], None] = print) -> list[str]:
    """The ops a resolved config needs, checked and loaded in this process (what `describe_run` calls
    before any process group); returns their names."""
    ops = ops_needed(document, device_type)
    if ops:
        preflight_ops(ops, device_capabilities(), announce)
    return ops


def _to_load(ops: list[str]) -> list[tuple[str, Any]]:
    """Each op with DeepSpeed's builder of it for this machine's accelerator (its CPU variant on a CPU;
    None where the accelerator has none), less the optional ops DeepSpeed would go without."""
    from deepspeed.accelerator import get_accelerator

    pairs = [(name, get_accelerator().create_op_builder(OPS[name].builder)) for name in ops]
    return [(name, b) for name, b in pairs if not OPS[name].optional or (b is not None and _compatible(b))]


def _problems(to_load: list[tuple[str, Any]], capabilities: list[tuple[int, int]]) -> list[str]:
    return [_message(name, causes) for name, builder in to_load if (causes := _causes(name, builder, capabilities))]


def _prebuilt(builder: Any) -> bool:
    """Built when DeepSpeed was installed (DS_BUILD_OPS=1) for this accelerator: loaded, never compiled."""
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(builder.name)) and accelerator_name == _accelerator_name()


def _is_cuda_build(builder: Any) -> bool:
    """Whether DeepSpeed builds `builder` with nvcc: a CUDA op on a CUDA build of torch that sees a GPU
    (elsewhere DeepSpeed builds its CPU variant)."""
    import torch
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    return isinstance(builder, CUDAOpBuilder) and torch.version.cuda is not None and torch.cuda.is_available()


def _compatible(builder: Any) -> bool:
    try:
        return bool(builder.is_compatible(verbose=False))
    except Exception:  # DeepSpeed's own probe treats a failing check as "not compatible" (probe_is_compatible)
        return False


def _causes(name: str, builder: Any, capabilities: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """(cause, fix) for each reason `builder` cannot be built or loaded here. Compilers matter only
    where torch has no build cached; ninja, the arch list and DeepSpeed's compatibility check are read
    on every load."""
    if builder is None:
        return [(f"DeepSpeed's {_accelerator_name()} accelerator has no {name} op", "")]
    if _prebuilt(builder):
        return []
    try:
        cached = any(op_build_dir(builder.name).glob("*.so"))
    except OSError as error:
        return [(f"torch's extensions folder cannot be made ({error})", "set TORCH_EXTENSIONS_DIR to a writable one")]
    causes = []
    compiler = os.environ.get("CXX", "c++")  # torch's choice (cpp_extension.get_cxx_compiler)
    if not cached and shutil.which((shlex.split(compiler) or [""])[0]) is None:
        causes.append(
            (f"no C++ compiler ({compiler!r} is not on PATH)", "install one (apt-get install g++) or set CXX to one")
        )
    if shutil.which("ninja") is None:
        causes.append(("ninja, which torch builds with, is not on PATH", "pip install ninja"))
    if _is_cuda_build(builder):
        from torch.utils.cpp_extension import CUDA_HOME

        # torch rewrites a cached build's ninja file in every new process, which joins CUDA_HOME's
        # paths (cpp_extension._join_cuda_home): a cached op still needs the toolkit's folder, not nvcc.
        causes.extend(toolkit_causes(CUDA_HOME) if not cached else _cuda_home_causes(CUDA_HOME))
        try:
            if _arch_list(builder, capabilities) is None:
                causes.append(
                    (f"{_ARCH_LIST_ENV} is unset and no GPU is visible to derive it from", _arch_fix(capabilities))
                )
        except ValueError as error:
            causes.append((str(error), _arch_fix(capabilities)))
    if not causes and not _compatible(builder):
        detail = f": {builder.error_log}" if builder.error_log else ""
        causes.append(
            (f"DeepSpeed's {type(builder).__name__} reports it cannot be built here{detail}", OPS[name].needs)
        )
    return causes


def toolkit_causes(cuda_home: str | None) -> list[tuple[str, str]]:
    """(cause, fix) where there is no nvcc at `cuda_home`, the CUDA install torch's extension builder
    found (torch.utils.cpp_extension.CUDA_HOME: CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda)."""
    import torch

    fix = f"install the CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME to it"
    if cuda_home is None:
        return [("no CUDA compiler: torch finds no CUDA_HOME (nor nvcc on PATH, nor /usr/local/cuda)", fix)]
    if not os.access(Path(cuda_home) / "bin" / "nvcc", os.X_OK):
        return [(f"no CUDA compiler: CUDA_HOME {cuda_home} has no bin/nvcc (a runtime-only install?)", fix)]
    return []


def _cuda_home_causes(cuda_home: str | None) -> list[tuple[str, str]]:
    if cuda_home is not None:
        return []
    import torch

    fix = f"install the CUDA toolkit matching torch's CUDA {torch.version.cuda} and set CUDA_HOME to it"
    return [("torch finds no CUDA_HOME, which loading a cached CUDA op reads", fix)]


def _arch_list(builder: Any, capabilities: list[tuple[int, int]]) -> str | None:
    """The arch list this build gets (None for a build without nvcc)."""
    if not _is_cuda_build(builder):
        return None
    return normalized_arch_list(os.environ.get(_ARCH_LIST_ENV), capabilities)


def _arch_fix(capabilities: list[tuple[int, int]]) -> str:
    example = normalized_arch_list(None, capabilities) or "9.0"
    return f"set {_ARCH_LIST_ENV}={example} (numbers; or unset it, and the engine derives it from the GPUs)"


def _message(name: str, causes: list[tuple[str, str]]) -> str:
    fixes = [fix for _, fix in causes if fix]
    if OPS[name].avoid:
        fixes.append(OPS[name].avoid)
    text = f"DeepSpeed op {name} cannot be built on this node: " + "; ".join(cause for cause, _ in causes)
    return text + (". Fix: " + "; or ".join(fixes) if fixes else "")


def _accelerator_name() -> str:
    """DeepSpeed's name of this machine's accelerator ("cuda", "cpu"), as its installed-ops record has it."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()._name


def _build(name: str, builder: Any, arch_list: str | None, announce: Callable[[str], None]) -> None:
    """Load `builder`'s op, building it under the node's lock where torch has no build cached. A failed
    build is one OpBuildError with the compiler's last lines."""
    try:
        folder = op_build_dir(builder.name)
        with _node_lock(folder, name, announce):
            if not any(folder.glob("*.so")):
                announce(f"building DeepSpeed op {name} once for this node (cached in {folder}); this can take minutes")
            with _environment(_ARCH_LIST_ENV, arch_list):
                builder.load(verbose=False)
    except Exception as error:
        lines = [line for line in str(error).splitlines() if line.strip()][-_ERROR_LINES:]
        cause = "the build failed:\n    " + "\n    ".join(lines)
        fix = "install what the compiler reports missing"
        raise OpBuildError(_message(name, [(cause, fix)])) from None


@contextmanager
def _node_lock(folder: Path, name: str, announce: Callable[[str], None]) -> Iterator[None]:
    """One build of an op per node: an `flock` beside its build folder, released by the kernel if its
    holder dies, and naming its holder to the processes that wait. torch's own lock (a `lock` file in
    the folder, created exclusively) stays behind when a build is killed, and every later load waits
    on it forever; under this lock no other rank is building, so such a file is stale and removed."""
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            announce(f"waiting for {holder} to build DeepSpeed op {name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            stale = folder / "lock"
            if stale.exists():
                announce(f"removing {stale}, left by a build of DeepSpeed op {name} that did not finish")
                stale.unlink()
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _environment(key: str, value: str | None) -> Iterator[None]:
    """`key` set to `value` for one build (left as it is where `value` is None), then put back: the
    image's own list, suffixes and all, is what torch and every other build read."""
    if value is None:
        yield
        return
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before
