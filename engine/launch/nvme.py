"""The folders ZeRO-Infinity swaps to, checked on each node before any process group.

DeepSpeed learns that an `nvme_path` cannot take its swap files only when its swapper first opens
one, inside `deepspeed.initialize` on every rank at once: a missing or read-only folder, a file
system that refuses direct I/O (its async_io op opens every swap file with O_DIRECT,
csrc/aio/common/deepspeed_aio_common.cpp), a drive that fills up mid-run, or an `mlock` of its
page-locked swap buffers that the user's `ulimit -l` refuses (csrc/pin_memory/page_alloc.cpp, which
returns no buffer at all). Each is one message here, naming the key and the fix, with the bytes the
planner (engine/plan) says each folder receives from this node and each rank locks.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.observability.units import format_bytes

_SWAP_FILES = "zero_stage_3/**/*.tensor.swp"  # where DeepSpeed's swappers write, inside nvme_path
_DIRECT_IO_BLOCK = 4096  # O_DIRECT wants buffer, offset and length aligned to the device's block
_CAP_IPC_LOCK = 14  # linux/capability.h: mlock without RLIMIT_MEMLOCK's limit


def nvme_paths(document: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each `nvme_path` a resolved config swaps to, with the keys that name it."""
    paths: dict[str, list[str]] = {}
    zero = document["zero_optimization"]
    for section in ("offload_param", "offload_optimizer"):
        if zero[section]["device"] == "nvme":
            paths.setdefault(str(zero[section]["nvme_path"]), []).append(f"zero_optimization.{section}.nvme_path")
    return paths


def nvme_problems(document: Mapping[str, Any], node_bytes: Mapping[str, int], locked_bytes: int) -> list[str]:
    """One message per problem with the NVMe folders of `document` on this node: `node_bytes` is what
    the node's ranks write to each folder, `locked_bytes` what one rank page-locks for its swap buffers."""
    problems = []
    for path, keys in nvme_paths(document).items():
        name = " and ".join(keys) + f" {path!r}"
        problem = _folder_problem(Path(path), node_bytes.get(path, 0))
        if problem:
            problems.append(f"{name}: {problem}")
    if nvme_paths(document):
        problem = _lock_problem(locked_bytes)
        if problem:
            problems.append(problem)
    return problems


def _folder_problem(path: Path, needed: int) -> str | None:
    existing = next((folder for folder in (path, *path.parents) if folder.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{existing} is not a folder; choose a folder on a local drive"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by this user; choose a folder on a local drive it can write"
    # A stopped run's swap files are DeepSpeed's to replace (`zero_stage_3/` inside nvme_path): room.
    free = shutil.disk_usage(existing).free + sum(swap.stat().st_size for swap in path.glob(_SWAP_FILES))
    if free < needed:
        return (
            f"the drive has {format_bytes(free)} free and this node's ranks swap {format_bytes(needed)} there "
            "(python -m engine plan counts it); free space or choose a larger drive"
        )
    return _direct_io_problem(existing)


def _direct_io_problem(folder: Path) -> str | None:
    """A one-block write with O_DIRECT, as DeepSpeed's async_io writes: some file systems (network and
    FUSE mounts, older tmpfs) refuse it, and the swapper would fail on its first write."""
    descriptor, probe = tempfile.mkstemp(prefix=".direct-io-probe-", dir=folder)
    os.close(descriptor)
    block = mmap.mmap(-1, _DIRECT_IO_BLOCK)  # page-aligned, as O_DIRECT needs
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_DIRECT)
        try:
            os.write(descriptor, block)
        finally:
            os.close(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return (
            f"its file system refuses direct I/O ({error.strerror}), which DeepSpeed's async_io swaps with; "
            "use a folder on a local drive (ext4, xfs)"
        )
    finally:
        block.close()
        os.unlink(probe)
    return None


def _lock_problem(locked_bytes: int) -> str | None:
    """DeepSpeed's swap buffers are `mlock`ed; a process without CAP_IPC_LOCK may lock RLIMIT_MEMLOCK."""
    if locked_bytes == 0 or _may_lock_without_limit():
        return None
    limit, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if limit == resource.RLIM_INFINITY or limit >= locked_bytes:
        return None
    return (
        f"each rank page-locks {format_bytes(locked_bytes)} of swap buffers for NVMe offload and `ulimit -l` allows "
        f"{format_bytes(limit)}: raise it (ulimit -l unlimited; memlock in /etc/security/limits.conf, or the "
        "container's --ulimit memlock=-1), or lower offload_param.buffer_count/buffer_size, "
        "offload_optimizer.buffer_count or zero_optimization.sub_group_size"
    )


def _may_lock_without_limit() -> bool:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    effective = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) >> _CAP_IPC_LOCK & 1)
