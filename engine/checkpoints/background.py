"""Checkpoint files written while training goes on (`trainer.async_save`).

A save copies the rank's state to host memory, which is all the step loop waits for, and a writer
process (engine/checkpoints/writer_process.py) writes the copy while the next steps train. The copy
is what makes that safe: the optimizer updates the weights and moments in place at the next step,
so a writer reading the live tensors would save a mixture of two steps. The checkpoint is published
(engine/checkpoints/store.py) only once every rank's files are whole, so a crash mid-write leaves
the previous checkpoint the latest.

DeepSpeed is given `BackgroundCheckpointEngine`, a `CheckpointEngine` of DeepSpeed's own interface,
through which its `save_checkpoint` writes every file (model states, ZeRO partitions, pipeline
layers). DeepSpeed's `DecoupledCheckpointEngine` is not used: it writes through FastPersist's
asynchronous I/O, which builds only where libaio is installed, and commits inside `engine.step()`,
which the pipeline engine does not call. The accelerate backend uses torch distributed
checkpoint's own `async_save`, in its process mode.
"""

from __future__ import annotations

import copy
import os
import queue
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.multiprocessing
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from engine.checkpoints.store import PARTIAL, tag_step
from engine.checkpoints.writer_process import Slot, serve

_ALIGNMENT = 64  # bytes: every small tensor's slot starts where any dtype may be viewed
_OWN_STORAGE = 1 << 20  # bytes: a tensor this large is copied into shared memory of its own
_POLL_S = 5.0  # how often a wait checks that the writer process is alive


class Packed(NamedTuple):
    """A file's state as the writer process takes it (`pack`)."""

    skeleton: Any  # the state, large tensors as shared copies, small ones as their `Slot` in `small`
    small: torch.Tensor  # the small tensors' bytes, in one shared buffer
    large: list[torch.Tensor]  # the shared storages of the large tensors, as uint8, in order


def pack(state: Any, reuse: Packed | None = None) -> Packed:
    """A copy of `state` in shared memory that the writer process maps rather than receives.

    Each large tensor is copied into shared memory of its own, which torch.save writes as it writes
    DeepSpeed's clones: one storage per tensor, so the file is the one a synchronous save writes.
    Small tensors share one buffer (one file descriptor for hundreds of scalars), which the writer
    clones apart. `reuse` is this file's last `Packed`, written by now: its memory is used again
    where the sizes match (already mapped, it copies faster than fresh pages fault in). Anything
    else is deep-copied: DeepSpeed's loss scaler is an object whose scale moves on, and the queue
    pickles it later, on its own thread."""
    spare = list(reuse.large) if reuse is not None else []
    large: list[torch.Tensor] = []
    small: list[tuple[Slot, torch.Tensor]] = []
    size = 0

    # A tensor met twice (a tied weight, under both its names) is one copy, as torch.save keeps it one.
    copies: dict[tuple, Slot | torch.Tensor] = {}

    def skeleton(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in copies:
                copies[key] = tensor_copy(value.detach())
            return copies[key]
        if isinstance(value, dict):
            copied = copy.copy(value)  # its type and attributes: a state_dict's `_metadata` versions
            if hasattr(copied, "__dict__"):
                copied.__dict__ = copy.deepcopy(value.__dict__)
            for key, item in value.items():
                copied[key] = skeleton(item)
            return copied
        if type(value) in (list, tuple):
            return type(value)(skeleton(item) for item in value)
        return copy.deepcopy(value)  # torch.Size among them: a tuple of its own type

    def tensor_copy(value: torch.Tensor) -> Slot | torch.Tensor:
        nonlocal size
        nbytes = value.numel() * value.element_size()
        if nbytes < _OWN_STORAGE:
            slot = Slot(size, value.dtype, tuple(value.shape))
            small.append((slot, value))
            size += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
            return slot
        index = len(large)
        fits = index < len(spare) and spare[index].numel() == nbytes
        storage = spare[index] if fits else shared_buffer(nbytes)
        large.append(storage)
        return storage.view(value.dtype).view(value.shape).copy_(value)

    packed = skeleton(state)
    fits = reuse is not None and reuse.small.numel() >= size
    buffer = reuse.small[:size] if fits else shared_buffer(size)
    for slot, source in small:
        nbytes = source.numel() * source.element_size()
        buffer[slot.offset : slot.offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
    return Packed(packed, buffer, large)


def shared_buffer(size: int) -> torch.Tensor:
    """`size` bytes in shared memory, as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(size, 1)), 0, (size,))


class BackgroundWriter:
    """A rank's writer process and the files it has yet to finish.

    A write that fails, or a writer process that died, is raised by the next `done()` or `wait()`
    on that rank: a save that cannot be whole must end the run rather than be published. Each file's
    shared memory is kept for the next save's file of the same name (`pack`'s `reuse`)."""

    def __init__(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._jobs, self._results = context.Queue(), context.Queue()
        self._process = context.Process(
            target=serve, args=(self._jobs, self._results, os.getpid()), name="checkpoint-writer", daemon=True
        )
        self._process.start()
        self._in_flight: dict[str, Packed] = {}  # path -> its copy, kept until the file is written
        self._spare: dict[str, Packed] = {}  # file name -> the copy its last write used

    def submit(self, state: Any, path: str, zipfile: bool) -> None:
        packed = pack(state, self._spare.pop(os.path.basename(path), None))
        self._in_flight[path] = packed
        self._jobs.put((packed.skeleton, packed.small, path, zipfile))

    def done(self) -> bool:
        self._collect(block=False)
        return not self._in_flight

    def wait(self) -> None:
        while self._in_flight:
            self._collect(block=True)

    def _collect(self, block: bool) -> None:
        while self._in_flight:
            try:
                path, error = self._results.get(block=block, timeout=_POLL_S if block else None)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the checkpoint writer process died (exit code {self._process.exitcode}) with "
                        f"{len(self._in_flight)} files of the save unwritten"
                    ) from None
                if block:
                    continue
                return
            self._spare[os.path.basename(path)] = self._in_flight.pop(path)
            if error is not None:
                raise RuntimeError(f"a checkpoint write failed: {path}: {error}")
            block = False


class BackgroundCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save checkpoint engine, its writes handed to a `BackgroundWriter`.

    `save` copies the state to shared host memory and returns; DeepSpeed's `commit` at the end of
    `save_checkpoint` returns at once, and the engine's publish waits for `writer.done()` on every
    rank instead. `during_write(step)` runs once the first file of the save of `step` has gone to
    the writer (a fault-injection point: a crash mid-write)."""

    def __init__(self, config_params: Any, during_write: Callable[[int], None]):
        super().__init__(config_params)
        self.name = "BackgroundCheckpointEngine"
        self.writer = BackgroundWriter()
        self._during_write = during_write
        self._step: int | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        self._step = tag_step(info.tag.removesuffix(PARTIAL))

    def preserves_storage_sharing(self) -> bool:
        # The writer process gives each tensor its own storage; DeepSpeed's clone would copy twice.
        return False

    def save(self, state_dict: Any, path: str) -> None:
        self.writer.submit(state_dict, path, self.zipfile_serialization)
        step, self._step = self._step, None
        if step is not None:
            self._during_write(step)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True
