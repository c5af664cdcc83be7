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
checkpoint's own `async_save` (engine/backends/accelerate_backend.py).
"""

from __future__ import annotations

import atexit
import os
import queue
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from engine.checkpoints.packing import Packed, pack
from engine.checkpoints.store import PARTIAL, tag_step
from engine.checkpoints.writer_process import serve

_POLL_S = 5.0  # how often a wait checks that the writer process is alive


class BackgroundWriter:
    """A rank's writer process and the files it has yet to finish.

    A write that fails, or a writer process that died, is raised by the next `done()` or `wait()`
    on that rank: a save that cannot be whole must end the run rather than be published. Each file's
    shared memory is kept for the next save's file of the same name (`pack`'s `reuse`)."""

    def __init__(self) -> None:
        self._start()
        self._in_flight: dict[str, Packed] = {}  # path -> its copy, kept until the file is written
        self._spare: dict[str, Packed] = {}  # file name -> the copy its last write used

    def wait_ready(self) -> None:
        """Return once the writer has imported torch: started while the rank initialises, so that
        the import (seconds of CPU) does not compete with the first steps, nor hold up the first save."""
        while not self._ready:
            self._collect(block=True, until_ready=True)

    def _start(self) -> None:
        context = torch.multiprocessing.get_context("spawn")
        self._jobs, self._results = context.Queue(), context.Queue()
        self._process = context.Process(
            target=serve, args=(self._jobs, self._results, os.getpid()), name="checkpoint-writer", daemon=True
        )
        self._process.start()
        self._ready = False
        # Before multiprocessing's own exit handler, which would SIGTERM this process (ignored) and wait.
        atexit.register(self._process.kill)

    def submit(self, state: Any, path: str, zipfile: bool) -> None:
        if not self._process.is_alive() and not self._in_flight:
            # Gone between saves (a signal to every process of the job before it could ignore it): a new one.
            self._start()
        packed = pack(state, self._spare.pop(os.path.basename(path), None))
        self._in_flight[path] = packed
        self._jobs.put((packed.skeleton, packed.small, path, zipfile))

    def done(self) -> bool:
        self._collect(block=False)
        return not self._in_flight

    def wait(self) -> None:
        while self._in_flight:
            self._collect(block=True)

    def _collect(self, block: bool, until_ready: bool = False) -> None:
        while self._in_flight or (until_ready and not self._ready):
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
            if path is None:
                self._ready = True
                continue
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

    def __init__(self, config_params: Any, writer: BackgroundWriter, during_write: Callable[[int], None]):
        super().__init__(config_params)
        self.name = "BackgroundCheckpointEngine"
        self.writer = writer
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
