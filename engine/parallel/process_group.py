"""Process-group set-up and the few collectives the loop needs.

Rank facts come from the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK), so they are known
before any process group exists: validation and data loading run first, and a bad config ends
every rank with the same message instead of a half-started job.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return env_rank() == 0


def init_process_group(device_type: str, timeout_s: float = 600.0) -> torch.device:
    """Start the process group the way DeepSpeed expects (NCCL on GPUs, gloo on CPU) and
    return this rank's device. A single process without a launcher gets a world of one, so the
    same code path runs with and without `deepspeed`."""
    import deepspeed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if device_type == "cuda":
        torch.cuda.set_device(env_local_rank())
        device = torch.device("cuda", env_local_rank())
    else:
        device = torch.device("cpu")
    deepspeed.init_distributed(
        dist_backend="nccl" if device_type == "cuda" else "gloo",
        timeout=timedelta(seconds=timeout_s),
        verbose=False,
    )
    if device_type == "cpu":
        _release_shm_buffers()
    return device


def _release_shm_buffers() -> None:
    """Unlink the shared-memory files DeepSpeed's CPU backend creates at start-up and never removes.

    DeepSpeed maps a 66 MiB /dev/shm buffer per rank for its inference all-reduce (training never
    uses it) and leaves the file behind when the process exits, so every CPU run leaked 66 MiB
    per rank until /dev/shm filled the machine's memory. Every rank has mapped every peer's buffer
    once `init_distributed` returns; after a barrier the names can go, and the mappings live on.
    """
    dist.barrier()
    pattern = f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_{env_rank()}"
    for path in Path("/dev/shm").glob(pattern):
        path.unlink(missing_ok=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def all_reduce_sum(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum scalar tensors over all ranks in one collective (one host sync, not one per value)."""
    keys = sorted(values)
    stacked = torch.stack([values[key].detach().double().reshape(()) for key in keys])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return dict(zip(keys, stacked.tolist(), strict=True))


def all_gather_rows(row: torch.Tensor) -> list[list[float]]:
    """Every rank's 1-d `row`, in rank order, on every rank: one collective and one host read."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [row.tolist()]
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    return torch.stack(rows).tolist()


def gather_to_main(value: Any) -> list[Any] | None:
    """Every rank's `value` on rank 0, in rank order (None elsewhere): a pickled gather, for the few
    small per-rank reports of a logged step."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def host_group() -> dist.ProcessGroup | None:
    """Collective: a group for flags that live in host memory, so agreeing on them never waits for
    the device: the default group where it is gloo (None), a gloo group beside NCCL otherwise."""
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return dist.new_group(backend="gloo")
    return None


def any_rank(flag: bool, group: dist.ProcessGroup | None) -> bool:
    """Collective: whether `flag` is true on any rank (one MAX all-reduce of one integer on `group`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value[0])


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
