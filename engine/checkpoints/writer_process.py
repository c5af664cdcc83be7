"""The process that writes a rank's checkpoint files under `trainer.async_save`.

A process, not a thread: a thread's torch.save holds the GIL for much of its work, and a training
thread that waits for the GIL at every operation ran at 0.47 of its speed beside one (at 0.94
beside this process; docs/design.md). It runs at idle CPU priority, so where the host's cores are
busy training it writes in their gaps, and it dies with its rank. This module imports torch only:
it is what a spawned process imports.
"""

from __future__ import annotations

import copy
import ctypes
import os
import signal
from multiprocessing.queues import Queue
from typing import Any, NamedTuple

import torch

_PR_SET_PDEATHSIG = 1


class Slot(NamedTuple):
    """Where a tensor of the state lies in the file's shared buffer."""

    offset: int  # bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


def serve(jobs: Queue, results: Queue, parent: int) -> None:
    """The writer's loop: each job is (skeleton, buffer, path, zipfile); the skeleton is the state
    with its large tensors in shared memory of their own and each small one replaced by its `Slot`
    in `buffer`. The small ones are cloned apart, so every tensor is saved in storage of its own, as
    DeepSpeed's `clone_tensors_for_torch_save` makes them: the file is the one a synchronous save
    writes. Each result is (path, None) or (path, the error)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above
        os._exit(1)
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)
    while (job := jobs.get()) is not None:
        skeleton, buffer, path, zipfile = job
        try:
            torch.save(rebuild(skeleton, buffer), path, _use_new_zipfile_serialization=zipfile)
            results.put((path, None))
        except Exception as error:  # reported to the rank, which ends the run
            results.put((path, f"{type(error).__name__}: {error}"))
        del job, skeleton, buffer


def rebuild(value: Any, buffer: torch.Tensor, clones: dict[Slot, torch.Tensor] | None = None) -> Any:
    """`value` with each `Slot` replaced by a copy of its bytes in `buffer`, as a tensor; a slot
    met twice (a tied weight) is one tensor, as it was in the state saved."""
    clones = {} if clones is None else clones
    if isinstance(value, Slot):
        if value not in clones:
            size = torch.Size(value.shape).numel() * torch.empty((), dtype=value.dtype).element_size()
            clones[value] = buffer[value.offset : value.offset + size].view(value.dtype).reshape(value.shape).clone()
        return clones[value]
    if isinstance(value, dict):
        rebuilt = copy.copy(value)  # its type and attributes (a state_dict's `_metadata`)
        for key, item in value.items():
            rebuilt[key] = rebuild(item, buffer, clones)
        return rebuilt
    if type(value) in (list, tuple):
        return type(value)(rebuild(item, buffer, clones) for item in value)
    return value
