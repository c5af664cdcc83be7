"""Checkpoint files written while training goes on (`trainer.async_save`).

A save takes a copy of the rank's state in host memory, which is all the step loop waits for, and a
thread writes the copy while the next steps train. The copy is what makes that safe: the optimizer
updates the weights and moments in place at the next step, so a writer reading the live tensors
would save a mixture of two steps. The checkpoint is published (engine/checkpoints/store.py) only
once every rank's writes are whole, so a crash mid-write leaves the previous checkpoint the latest.

DeepSpeed is given `ThreadedCheckpointEngine`, a `CheckpointEngine` of DeepSpeed's own interface,
through which its `save_checkpoint` writes every file (model states, ZeRO partitions, pipeline
layers). DeepSpeed's `DecoupledCheckpointEngine` is not used: it writes through FastPersist's
asynchronous I/O, which builds only where libaio is installed, and commits inside `engine.step()`,
which the pipeline engine does not call. The accelerate backend uses torch distributed
checkpoint's own `async_save`, with `HookedFileSystemWriter` as its writer.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from torch.distributed.checkpoint import FileSystemWriter

from engine.checkpoints.store import PARTIAL, tag_step


def host_copy(value: Any) -> Any:
    """A copy of `value` that nothing the training does later can change: tensors copied to host
    memory (each in storage of its own, as DeepSpeed's `clone_tensors_for_torch_save` makes them),
    containers rebuilt, anything else deep-copied (DeepSpeed's loss scaler is an object whose scale
    moves on)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        copied = type(value)() if type(value) is not dict else {}
        for key, item in value.items():
            copied[key] = host_copy(item)
        return copied
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(host_copy(item) for item in value)
    return copy.deepcopy(value)


class BackgroundWriter:
    """One thread that runs the writes given to it in order; `done()` says whether all have run.

    A write that fails is raised by the next `done()` or `wait()`, on the rank whose write failed:
    a save that cannot be whole must end the run rather than be published."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="checkpoint-writer", daemon=True).start()

    def submit(self, write: Callable[[], None]) -> None:
        with self._idle:
            self._outstanding += 1
        self._queue.put(write)

    def done(self) -> bool:
        with self._idle:
            self._raise()
            return self._outstanding == 0

    def wait(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0 or self._error is not None)
            self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"a checkpoint write failed: {self._error}") from self._error

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                write()
            except BaseException as error:  # reported to the training thread, which ends the run
                with self._idle:
                    self._error = error
            with self._idle:
                self._outstanding -= 1
                self._idle.notify_all()


class ThreadedCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save checkpoint engine, its writes moved to a `BackgroundWriter`.

    `save` copies the state to host memory and returns; DeepSpeed's `commit` at the end of
    `save_checkpoint` returns at once, and the engine's publish waits for `writer.done()` on every
    rank instead. `during_write(step)` runs in the writer once the first file of the save of `step`
    is written (a fault-injection point: a crash mid-write)."""

    def __init__(self, config_params: Any, during_write: Callable[[int], None]):
        super().__init__(config_params)
        self.name = "ThreadedCheckpointEngine"
        self.writer = BackgroundWriter()
        self._during_write = during_write
        self._step: int | None = None
        self._first_file = False

    def create(self, info: CheckpointCommitInfo) -> None:
        self._step = tag_step(info.tag.removesuffix(PARTIAL))
        self._first_file = True

    def preserves_storage_sharing(self) -> bool:
        # The host copy already gives each tensor its own storage; DeepSpeed's clone would copy twice.
        return False

    def save(self, state_dict: Any, path: str) -> None:
        snapshot = host_copy(state_dict)
        first, step = self._first_file, self._step
        self._first_file = False

        def write() -> None:
            TorchCheckpointEngine.save(self, snapshot, path)
            if first and step is not None:
                self._during_write(step)

        self.writer.submit(write)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True


class HookedFileSystemWriter(FileSystemWriter):
    """torch distributed checkpoint's file writer, calling `during_write(step)` in its background
    thread once the rank's data files are written, before the checkpoint's metadata (the accelerate
    backend's fault-injection point: a crash mid-write)."""

    def __init__(self, path: str, step: int, during_write: Callable[[int], None]):
        super().__init__(path)
        self._step, self._during_write = step, during_write

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        self._during_write(self._step)
        return written
