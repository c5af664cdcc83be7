"""What this rank holds, measured on the live backend: the bytes of its parameters, gradients and
optimizer states, counted from the tensors themselves, plus the process RSS and the device peaks.

Model states are counted by storage, not by tensor: a ZeRO rank's parameters are views into one
flat, padded buffer, a tied weight is one tensor under two names, and counting each distinct
untyped storage once gives exactly the bytes allocated, padding included. The planner
(`engine/plan`) predicts these same three numbers, so each one has a fixed meaning:

- parameters: the model's weights as this rank holds them after an optimizer step (its ZeRO-3
  partitions and persistent parameters; the whole flat buffer under ZeRO-1/2; its stage and tensor
  shard of the model under pipeline and tensor parallelism), in the training dtype.
- gradients: every gradient tensor alive just before the optimizer step, when all of them are held
  (per-parameter `.grad`, ZeRO's partitioned gradient buffers, the fp32 gradient copy of an
  offloaded optimizer). Communication buckets and offload staging buffers are workspace, not
  gradients, and are not counted.
- optimizer: fp32 master weights kept by a mixed-precision or ZeRO optimizer, and every tensor in
  the torch optimizer's state (Adam's moments, and torch Adam's 4-byte `step` tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil
import torch


@dataclass(frozen=True)
class ModelStateTensors:
    """The tensors behind a rank's parameters and optimizer states, as a backend reports them."""

    parameters: list[torch.Tensor]
    optimizer: list[torch.Tensor]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard; meta and
    freed tensors count nothing)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = local_tensor(tensor)
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor (FSDP2), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in a torch optimizer's per-parameter state; ints (DeepSpeed's Adam step) hold
    no tensor memory."""
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


class StepWatch:
    """Counts the model-state bytes at an optimizer step: the gradients on entry to `step`, after
    every micro-batch's backward and every reduction, the one moment all of them exist; parameters
    and optimizer states on its return, when ZeRO-3 has re-gathered its persistent parameters and
    nothing is gathered for a forward pass (an evaluation would leave ZeRO-3's gathered).

    It replaces `step` on the optimizer instance (DeepSpeed's wrappers are not torch optimizers,
    so torch's step hooks would miss them); the call itself is passed on unchanged. It counts only
    while `counting()` is true (the steps the loop logs): walking every tensor is Python work that
    other steps should not pay.
    """

    def __init__(
        self,
        optimizer: Any,
        gradients: Callable[[], Iterable[torch.Tensor | None]],
        states: Callable[[], ModelStateTensors],
        counting: Callable[[], bool],
    ):
        self.gradient_bytes = self.parameter_bytes = self.optimizer_bytes = 0
        step = optimizer.step

        def counting_step(*args: Any, **kwargs: Any) -> Any:
            if not counting():
                return step(*args, **kwargs)
            self.gradient_bytes = storage_bytes(gradients())
            result = step(*args, **kwargs)
            held = states()
            self.parameter_bytes = storage_bytes(held.parameters)
            self.optimizer_bytes = storage_bytes(held.optimizer)
            return result

        optimizer.step = counting_step


def rank_memory(watch: StepWatch) -> dict[str, int]:
    """This rank's memory, for the metrics record: model-state bytes (exact, as `watch` counted them
    at the last timed optimizer step; 0 before the first), the process RSS now, and on CUDA the
    allocator's peaks since the start of the run."""
    record = {
        "parameter_bytes": watch.parameter_bytes,
        "gradient_bytes": watch.gradient_bytes,
        "optimizer_bytes": watch.optimizer_bytes,
        "rss_bytes": psutil.Process().memory_info().rss,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["device_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
        record["device_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    return record
