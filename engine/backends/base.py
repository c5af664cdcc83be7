"""The contract between the step loop and a training backend: `Backend`, the `BackendSettings`
every backend is built from, and the `StepHooks` through which faults, benchmarks and tests step
into a run without the loop or any backend knowing them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.token_mean import TargetCount
from engine.config.batch import BatchTriple
from engine.config.rules import offloads
from engine.observability.memory import StepWatch
from engine.observability.step_phases import PhaseTimer
from engine.parallel.layout import ParallelLayout
from engine.parallel.sequence import SequenceShards
from models import ModelFamily

if TYPE_CHECKING:
    from deepspeed.monitor.monitor import MonitorMaster
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

Batch = Mapping[str, torch.Tensor]


class StepHooks:
    """Points where code outside the engine steps into a run; each does nothing here.

    The fault injector (engine/failures/faults.py) and the paired benchmarks (bench/paired.py)
    subclass it; the loop and the backends call it and know nothing else of them."""

    def before_step(self, step: int) -> None:
        """Optimizer step `step` (counted from 1) is about to start."""

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Each micro-batch loss, before backward; returns the loss to differentiate."""
        return loss

    def after_step(self, step: int) -> None:
        """Step `step` is done and its health checked (a step that ends the run never gets here; one
        skipped under `trainer.nonfinite: "skip"` does)."""

    def before_publish(self, step: int) -> None:
        """This rank's files of the checkpoint of `step` are written; the checkpoint is not yet published."""

    def before_eval(self, step: int) -> None:
        """The evaluation after step `step` is about to start."""

    def before_export(self, step: int) -> None:
        """The export of the checkpoint of `step`, the run's last, is about to start."""

    def during_write(self, step: int) -> None:
        """The first file of the checkpoint of `step` has gone to the background writer, its files not
        yet whole (trainer.async_save)."""


@dataclass(frozen=True)
class BackendSettings:
    """Everything a backend is built from besides the model: one shape for every backend.

    `deepspeed_config` holds the config's DeepSpeed keys, as `deepspeed.initialize` takes them; the
    accelerate backend reads the same keys (engine/backends/optim.py). `grid` is DeepSpeed's
    process-group grid where the layout splits the model."""

    backend: str  # trainer.backend, resolved: "deepspeed" or "accelerate"
    family: ModelFamily
    model_fields: Mapping[str, Any]  # the model section, as the family builds from it
    device: torch.device
    input_dtype: torch.dtype  # what floating inputs are cast to: the weights' dtype
    deepspeed_config: dict[str, Any]
    batch: BatchTriple
    precision: str  # "fp32", "bf16" or "fp16": the weights' dtype in training
    weight_decay_on: str
    zero_stage: int
    accelerate_wrapper: str | None  # EngineConfig.accelerate_wrapper
    layout: ParallelLayout
    pipeline_partition_method: str
    pipeline_activation_checkpoint_interval: int
    hooks: StepHooks
    compile: bool  # trainer.compile
    nonfinite: str  # trainer.nonfinite: "stop" or "skip"
    async_save: bool  # trainer.async_save: `save` returns before its files are whole
    grid: PipelineParallelGrid | None = None
    # The training labels can hold IGNORE_INDEX (prompts, padding): each step counts its target
    # tokens (engine/backends/token_mean.py). Where every label is a target it need not.
    masked_labels: bool = False
    # trainer.seed, which alone draws model.lora's adapters (models/lora.py `peft_model`).
    seed: int = 0

    @property
    def offloads(self) -> bool:
        return offloads(self.deepspeed_config["zero_optimization"])


class Backend(ABC):
    """A model made trainable by some distributed library.

    The loop hands over batches as the loader yields them; the backend moves them, runs forward and
    backward over the micro-batches of one step and applies the optimizer, however its library
    schedules that work (micro-batch by micro-batch, or a pipeline schedule).
    """

    device: torch.device
    # What floating inputs are cast to on the device (`to_device`): the weights' dtype.
    input_dtype: torch.dtype = torch.float32
    hooks: StepHooks
    # Counts model-state bytes at the optimizer step of timed steps (engine/observability/memory.py).
    state_watch: StepWatch
    # Whether the model runs through torch.compile (`trainer.compile`), as the library reports it.
    compiled: bool = False
    # The timer of the step in progress, when the loop times it (its logged steps).
    _timer: PhaseTimer | None = None
    # Where the training labels can hold IGNORE_INDEX: how a step divides each micro-batch's loss.
    target_count: TargetCount | None = None
    # Under sequence parallelism: this rank's slice of every sequence (engine/parallel/sequence.py).
    sequence: SequenceShards | None = None

    def train_step(self, batches: Iterator[Batch], timer: PhaseTimer | None = None) -> torch.Tensor:
        """One optimizer step over the next gradient_accumulation_steps micro-batches, its phases
        timed into `timer` when one is given (engine/observability/step_phases.py).

        Returns a loss on the device (no host sync) whose mean over all ranks is the step's loss: the
        mean over the target tokens of the global batch (engine/backends/token_mean.py).
        """
        self._timer = timer
        return self._train_step(batches)

    @abstractmethod
    def _train_step(self, batches: Iterator[Batch]) -> torch.Tensor: ...

    def micro_batches(
        self, batches: Iterator[Batch], count: int
    ) -> tuple[Iterator[dict[str, torch.Tensor]], torch.Tensor | None]:
        """The step's `count` micro-batches on the device, and the divisor of each one's summed token
        loss (`TargetCount.divisor`; None: each takes its own mean, the global one where every label is
        a target). Counting needs every label of the step before its first forward, so those
        micro-batches are taken up front, their copies (token ids) small beside a forward; the others
        move one at a time, as the step takes them."""
        moved = (to_device(self.sliced(next(batches)), self.device, self.input_dtype) for _ in range(count))
        if self.target_count is None:
            return moved, None
        with self.phase("data"):
            taken = list(moved)
            return iter(taken), self.target_count.divisor(taken)

    def sliced(self, batch: Batch) -> Batch:
        """`batch`, or under sequence parallelism this rank's slice of it."""
        return batch if self.sequence is None else self.sequence.shard(dict(batch))

    @property
    def timing(self) -> bool:
        """Whether the step in progress is timed: measurements that cost a sync happen only then."""
        return self._timer is not None

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

    def nonfinite_gradients(self) -> torch.Tensor | None:
        """Whether the last step's gradients held a NaN or inf, as a bool on the device (no host
        sync), where the backend has their norm at hand; None where it has not (DeepSpeed's ZeRO and
        mixed-precision optimizers test them themselves and count what they drop in `skipped_steps`)."""
        return None

    @abstractmethod
    def loss_scale(self) -> float | None:
        """fp16's current loss scale; None where no loss scaler runs."""

    def deepspeed_monitor(self) -> MonitorMaster | None:
        """DeepSpeed's engine monitor, which the metric sinks reuse (`engine/observability/sinks.py`): one writer
        per directory. None where no DeepSpeed engine runs."""
        return None

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (before clipping); None where the library does
        not compute one. Read at log points only: it may cost a host sync."""
        return None

    def step_breakdown(self) -> dict[str, float] | None:
        """Seconds of the last step by phase (data, forward, backward, step, ...), if it was timed."""
        return None if self._timer is None else dict(self._timer.seconds)

    def phase(self, name: str) -> AbstractContextManager[None]:
        return nullcontext() if self._timer is None else self._timer.phase(name)

    def stage_layers(self) -> list[str] | None:
        """Each pipeline stage's layer range, for the start-up layout table; None without stages."""
        return None

    def finish(self, output_dir: Path, write_line: Callable[[str], None]) -> None:
        """Collective, once after the last step: whatever this backend reports of the run (a
        pipeline's measured schedule). Nothing by default."""
        return None

    @abstractmethod
    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank writes its part of checkpoint `tag` under `checkpoint_dir` (collective). No
        `latest`: `engine.checkpoints.store.publish_checkpoint` publishes the tag once every rank is done."""

    def writes_done(self) -> bool:
        """Whether this rank's files of the last `save` are whole (they are when it returns, unless the
        backend writes them in the background: trainer.async_save)."""
        return True

    def wait_for_writes(self) -> None:
        """Return once this rank's files of the last `save` are whole."""
        return None

    @abstractmethod
    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        """Every rank restores checkpoint `tag`; returns the client state saved with it."""

    @abstractmethod
    def local_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's persistent buffers by its own names (`models.module_state.persistent_buffers`)."""

    @abstractmethod
    def load_universal(self, tag_dir: Path) -> dict[str, Any]:
        """Every rank restores checkpoint `tag_dir`, saved on another layout, from the universal form
        `engine.checkpoints.manager.CheckpointManager` converted it to; returns the client state saved with it."""

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
