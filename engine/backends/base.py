"""The interface the training loop programs against."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.step_phases import PhaseTimer

if TYPE_CHECKING:
    from deepspeed.monitor.monitor import MonitorMaster

Batch = Mapping[str, torch.Tensor]


class Backend(ABC):
    """A model made trainable by some distributed library.

    The loop hands over batches as the loader yields them; the backend moves them, runs forward and
    backward over the micro-batches of one step and applies the optimizer, however its library
    schedules that work (micro-batch by micro-batch, or a pipeline schedule).
    """

    device: torch.device
    # Applied to every micro-batch loss before backward while set: the `nan` fault's entry point
    # (engine/failures/faults.py), a hook so that no backend knows about faults.
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Set by the loop for the steps it logs: train_step then times its phases (engine/step_phases.py).
    phase_timer: PhaseTimer | None = None
    # Whether the model runs through torch.compile (`trainer.compile`), as the library reports it.
    compiled: bool = False

    @abstractmethod
    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        """One optimizer step over the next gradient_accumulation_steps micro-batches.

        Returns a loss on the device (no host sync) whose mean over all ranks is the step's mean loss.
        """

    @abstractmethod
    def eval_sums(self, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
        """The family's evaluation sums over this rank's batches, arranged so that summing them over
        all ranks counts every sample once (ranks holding a copy of another's result give zeros)."""

    @abstractmethod
    def learning_rate(self) -> float: ...

    def describe(self) -> str | None:
        """A start-up line on what the backend built, where the config alone does not say it.
        Collective: every rank calls it."""
        return None

    @abstractmethod
    def skipped_steps(self) -> int:
        """Updates the optimizer has dropped so far because a gradient was NaN or inf (an fp16
        overflow among them), leaving the weights and the LR schedule as they were. The same on every
        rank: the test runs on gradients already reduced over the ranks."""

    @abstractmethod
    def loss_scale(self) -> float | None:
        """fp16's current loss scale; None where no loss scaler runs."""

    def deepspeed_monitor(self) -> MonitorMaster | None:
        """DeepSpeed's engine monitor, which the metric sinks reuse (`engine/sinks.py`): one writer
        per directory. None where no DeepSpeed engine runs."""
        return None

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping); None where the library does
        not compute one. Read at log points only: it may cost a host sync."""
        return None

    def step_breakdown(self) -> dict[str, float] | None:
        """Seconds of the last timed step by phase (data, forward, backward, step, ...)."""
        return None if self.phase_timer is None else dict(self.phase_timer.seconds)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext() if self.phase_timer is None else self.phase_timer.phase(name)

    def hooked(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_hook is None else self.loss_hook(loss)

    @abstractmethod
    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank writes its part of checkpoint `tag` under `checkpoint_dir` (collective). No
        `latest`: `engine.checkpoints.store.save_checkpoint` publishes the tag once every rank is done."""

    @abstractmethod
    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        """Every rank restores checkpoint `tag`; returns the client state saved with it."""

    @abstractmethod
    def local_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers by its own names (`models.common.persistent_buffers`)."""

    @abstractmethod
    def load_universal(self, tag_dir: Path) -> dict[str, Any]:
        """Every rank restores checkpoint `tag_dir`, saved on another layout, from the universal form
        `engine.run.reshape_checkpoint` converted it to; returns the client state saved with it."""

    @abstractmethod
    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor] | None:
        """The full fp32 weights of the model as saved in checkpoint `tag`: on rank 0, None elsewhere.

        Collective: every rank calls it.
        """


def to_device(batch: Batch, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Move a batch; floating inputs take the model's dtype (DeepSpeed does not cast under bf16)."""
    return {
        key: value.to(device, dtype=dtype if value.is_floating_point() else None, non_blocking=True)
        for key, value in batch.items()
    }
