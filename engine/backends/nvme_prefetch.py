"""ZeRO-3's NVMe parameter prefetch, without the duplicates DeepSpeed 0.19.8 hands its swapper.

Before each submodule, `PartitionedParameterCoordinator.__prefetch_nvme_param_partitions`
(zero/partitioned_param_coordinator.py) walks the upcoming part of the recorded trace and lists
every parameter still on NVMe, once per use: a parameter used twice within that window (in the
forward and again in the backward of a small model, or by a module called twice) is listed twice,
and `AsyncPartitionedParameterSwapper.swap_in` gives the first a buffer and fails on the second
(`param 24 already assigned swap buffer id 1`, at the second step of a 2-layer GPT with every
partition on NVMe). Swapping each parameter in once is what the caller meant: both uses read the
same buffer.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = "_engine_deduplicates_swap_in"


def deduplicate_nvme_swap_in() -> None:
    """Make the parameter swapper's `swap_in` take each parameter once (idempotent)."""
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    if getattr(AsyncPartitionedParameterSwapper, _INSTALLED, False):
        return
    swap_in = AsyncPartitionedParameterSwapper.swap_in

    def once_each(self: Any, params: list, async_op: bool = True, swap_in_buffers: list | None = None) -> None:
        if swap_in_buffers is None:  # buffers given by the caller pair with its list as it is
            params = list({id(param): param for param in params}.values())
        swap_in(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

    AsyncPartitionedParameterSwapper.swap_in = once_each
    setattr(AsyncPartitionedParameterSwapper, _INSTALLED, True)
