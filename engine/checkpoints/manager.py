"""One run's checkpoints: where it resumes from and how it saves.

The manager owns everything a resume restores besides what the backend's library loads itself:
the conversion to a universal checkpoint when the layout changed, each rank's RNG state and
persistent buffers, and a streamed corpus's position. Which resumes must convert is decided before
any process group (`engine.checkpoints.reshape.needs_conversion`, called by engine/describe.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from engine.checkpoints.from_torch import universal_from_torch, universal_from_zero0
from engine.checkpoints.reshape import CheckpointManifest
from engine.checkpoints.store import (
    CheckpointRef,
    checkpoint_root,
    latest_checkpoint,
    load_data_position,
    load_rank_buffers,
    load_rng_state,
    publish_checkpoint,
    stage_checkpoint,
    step_tag,
)
from engine.checkpoints.universal import UNIVERSAL_FOLDER, convert_to_universal
from engine.parallel.process_group import any_rank, barrier, env_rank, host_group, is_main_process


class Checkpointable(Protocol):
    """What the manager needs of a backend (engine/backends/base.py declares each)."""

    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None: ...

    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]: ...

    def load_universal(self, tag_dir: Path) -> dict[str, Any]: ...

    def local_buffers(self) -> dict[str, torch.Tensor]: ...

    def writes_done(self) -> bool: ...

    def wait_for_writes(self) -> None: ...


class Positioned(Protocol):
    """A reader whose place is saved with each checkpoint (data.streaming.StreamedWindows)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Pending(NamedTuple):
    """A save whose files are still being written (`trainer.async_save`)."""

    step: int
    started: float  # time.perf_counter() when the save began
    blocked_s: float  # how long the save held the training up before its files went to the background


class CheckpointManager:
    """Resumes a run from `source` (None: a fresh start) and saves it under `output_dir`.

    `manifest` is this run's record (CheckpointManifest), written with every checkpoint; `saved_manifest`
    the one `source` was saved with; `reshape` whether the layouts differ so that the resume goes through
    DeepSpeed's universal form. `before_publish(step)` runs on every rank once its files of a save
    are written (a fault-injection point).

    With `background` (`trainer.async_save`) the backend writes its files on a thread, and a save
    is published later, by `settle` at a step boundary, once every rank's files are whole. At most
    one save is in flight: the next waits for it. `last_save_s` is the last save's duration from its
    start to its files being whole on this rank, the margin trainer.max_wall_time leaves."""

    def __init__(
        self,
        output_dir: Path,
        source: CheckpointRef | None,
        manifest: CheckpointManifest,
        saved_manifest: CheckpointManifest | None,
        reshape: bool,
        world_size: int,
        keep_last: int,
        before_publish: Callable[[int], None] = lambda step: None,
        background: bool = False,
    ):
        self.root = checkpoint_root(output_dir)
        self.source, self.manifest, self.saved_manifest, self.reshape = source, manifest, saved_manifest, reshape
        self.world_size, self.keep_last, self.before_publish = world_size, keep_last, before_publish
        self.background = background
        self.last_save_s: float | None = None
        self._backend: Checkpointable | None = None
        self._stream: Positioned | None = None
        self._pending: _Pending | None = None
        self._group = None

    def convert_source(self, train_batch_size: int) -> None:
        """Collective, before the backend exists (DeepSpeed decides at initialisation how its
        optimizer loads): rank 0 converts a checkpoint saved on another layout to its universal
        form, kept beside it for later resumes; the others wait."""
        if not self.reshape:
            return
        tag_dir = self.source.path
        if is_main_process() and not (tag_dir / UNIVERSAL_FOLDER).is_dir():
            print(f"converting {tag_dir} to a DeepSpeed universal checkpoint for this layout", flush=True)
            if self.saved_manifest.backend == "accelerate":
                universal_from_torch(tag_dir, train_batch_size)
            elif self.saved_manifest.zero_stage == 0:
                universal_from_zero0(tag_dir)
            else:
                convert_to_universal(tag_dir)
        barrier()

    def resume(self, backend: Checkpointable, stream: Positioned | None = None) -> int:
        """Collective: restore `backend` (and `stream`'s position) from the source; the step to
        start from, 0 for a fresh start. Later saves write this backend and stream."""
        self._backend, self._stream = backend, stream
        if self.background:
            self._group = host_group()
        if self.source is None:
            return 0
        tag_dir = self.source.path
        saved = backend.load_universal(tag_dir) if self.reshape else backend.load(self.source.root, self.source.tag)
        # Generators and each rank's buffers continue where they were only on the layout that saved them.
        if saved.get("world_size") == self.world_size:
            load_rng_state(tag_dir, env_rank())
            load_rank_buffers(tag_dir, env_rank(), backend.local_buffers())
        if stream is not None:
            stream.load_state_dict(load_data_position(tag_dir, env_rank()))
        return int(saved["step"])

    def save(self, step: int) -> None:
        """Collective: save the checkpoint of `step`; published before this returns, or with
        `background` by a later `settle` (a save still in flight is published first)."""
        self.settle(wait=True)
        backend, started = self._backend, time.perf_counter()
        stage_checkpoint(
            lambda root, tag: backend.save(root, tag, {"step": step, "world_size": self.world_size}),
            self.root,
            step,
            manifest=self.manifest,
            buffers=backend.local_buffers(),
            data_position=self._stream.state_dict() if self._stream is not None else None,
        )
        self._pending = _Pending(step, started, time.perf_counter() - started)
        if not self.background:
            self.settle(wait=True)

    def settle(self, wait: bool) -> None:
        """Collective, at a step boundary: publish the save in flight once every rank's files of it
        are whole; with `wait`, after waiting for them. One flag reduced over the ranks while a save
        is in flight, nothing otherwise."""
        pending = self._pending
        if pending is None:
            return
        if wait:
            self._backend.wait_for_writes()
        elif any_rank(not self._backend.writes_done(), self._group):
            return
        self.last_save_s = time.perf_counter() - pending.started
        self._pending = None
        tag = publish_checkpoint(self.root, pending.step, self.keep_last, self.before_publish)
        if is_main_process():
            waited = f" (training waited {pending.blocked_s:.2f} s; written in the background)"
            waited = waited if self.background else ""
            print(f"checkpoint {tag} published {self.last_save_s:.2f} s after its save began{waited}", flush=True)

    def keep_untrained(self, step: int) -> None:
        """Collective, when a run trained nothing: the export reads this run's own checkpoint, so the
        starting state is saved here first: a fresh start's weights (`trainer.max_steps: 0`, an
        `init_from` exported unchanged), or a source from elsewhere or from another layout, in this
        layout (a conversion without training)."""
        if self.source is None or self.source.path != self.root / step_tag(step) or self.reshape:
            self.save(step)
            self.settle(wait=True)

    def latest(self) -> Path | None:
        """The newest published checkpoint of this run, or None."""
        return latest_checkpoint(self.root)
