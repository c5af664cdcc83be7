"""DeepSpeed's pipeline engine as a backend: the model's layers cut into stages
(`deepspeed.pipe.PipelineModule`), each step one `train_batch` that runs DeepSpeed's 1F1B schedule
over the step's micro-batches (the config's gradient_accumulation_steps).

The family supplies the layer list, how a batch splits into the first stage's input and the last
stage's labels, and the losses; DeepSpeed does the scheduling, the activation and gradient
transfers between stages, and keeps tied weights (GPT's embedding and head) equal across stages.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from engine.backends.base import BackendSettings, Batch, to_device
from engine.backends.deepspeed_backend import DeepSpeedEngineBackend
from engine.backends.optim import parameter_groups
from engine.backends.pipeline_timeline import PipelineEvent, RankTimeline, step_breakdown, write_pipeline_timeline
from engine.backends.zero_checks import defer_norm_checks
from engine.parallel.consolidate import fp16_optimizer_masters, gather_full_state, tensor_names
from models.labels import IGNORE_INDEX
from models.tiling import logits_free_loss

# The event kind (engine/backends/pipeline_timeline.py) of each instruction DeepSpeed's schedules issue.
INSTRUCTION_KINDS = {
    schedule.LoadMicroBatch: "load_micro_batch",
    schedule.ForwardPass: "forward",
    schedule.BackwardPass: "backward",
    schedule.SendActivation: "send_activation",
    schedule.RecvActivation: "recv_activation",
    schedule.SendGrad: "send_grad",
    schedule.RecvGrad: "recv_grad",
    schedule.ReduceTiedGrads: "reduce_tied_grads",
    schedule.ReduceGrads: "reduce_grads",
    schedule.OptimizerStep: "optimizer_step",
}


def count_in_norm_once(module: torch.nn.Module, tensor_rank: int) -> None:
    """Mark the parameters whose gradients this rank adds to the global gradient norm.

    DeepSpeed's fp32 ZeRO-0 clipping counts a parameter on every model-parallel rank when it is
    marked model-parallel, and otherwise only on model-parallel rank 0, which is the first
    pipeline stage alone: later stages' replicated parameters would drop out of the norm, and it
    ignores the marker DeepSpeed puts on the second copy of a tied weight, which would count
    twice. So: every parameter of tensor shard 0 and every sharded parameter is marked, and the
    second copy of a tied weight is unmarked. The other norm paths (ZeRO-1, bf16) skip tied
    copies first and then read the same marks, so all of them count each gradient once.
    """
    for parameter in module.parameters():
        if getattr(parameter, "ds_pipe_replicated", False):
            parameter.model_parallel = parameter.tensor_model_parallel = False
        elif tensor_rank == 0 or getattr(parameter, "tensor_model_parallel", False):
            parameter.model_parallel = True


class InstructionTimer:
    """Times every instruction a pipeline engine executes inside `record`, and keeps the events of
    the last recorded step.

    `_exec_schedule` binds `self._INSTRUCTION_MAP[type(cmd)]` to the engine for each instruction, so
    a map set on the engine instance shadows the class's for this engine alone: each method is
    wrapped once here, and DeepSpeed's code is neither copied nor subclassed. Outside a recorded
    step a wrapper costs one attribute test; inside, two clock reads and one small object.
    """

    def __init__(self, engine: PipelineEngine, device: torch.device):
        self.events: list[PipelineEvent] = []
        # Every recorded step's forward and backward compute seconds: the stage's cost per pass is
        # their minimum (timeline.pooled_costs), steadier than one step's passes on a noisy machine.
        self.compute_samples: dict[str, list[float]] = {"forward": [], "backward": []}
        self._recording: list[PipelineEvent] | None = None
        self._seen: Counter[str] = Counter()
        # On a GPU an instruction returns once its kernels are queued; only a sync makes the clock
        # read when they have run. Recorded steps are the ones the loop times anyway (one per log).
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        # A pass's compute: CPU time on a CPU, where another process holding the core is not this stage's cost.
        self._compute_clock = time.perf_counter if device.type == "cuda" else time.process_time
        engine._INSTRUCTION_MAP = {
            instruction: self._timed(INSTRUCTION_KINDS[instruction], method)
            for instruction, method in PipelineEngine._INSTRUCTION_MAP.items()
        }

    def record(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()` (one train_batch), with its instructions recorded as the last step's events."""
        self._recording, self._seen = [], Counter()
        try:
            loss = run()
            self.events = self._recording
            for event in self.events:
                if event.kind in self.compute_samples:
                    self.compute_samples[event.kind].append(event.compute_seconds)
        finally:
            self._recording = None
        return loss

    def _timed(self, kind: str, method: Callable[..., None]) -> Callable[..., None]:
        def timed(engine: PipelineEngine, **kwargs: int) -> None:
            if self._recording is None:
                return method(engine, **kwargs)
            self._synchronize()
            start, compute_start = time.perf_counter(), self._compute_clock()
            method(engine, **kwargs)
            self._synchronize()
            end, compute = time.perf_counter(), self._compute_clock() - compute_start
            # DeepSpeed names a buffer slot, not the micro-batch; every per-micro-batch instruction
            # kind handles a step's micro-batches in order, so the n-th of its kind is micro-batch n.
            micro_batch = None
            if "buffer_id" in kwargs:
                micro_batch = self._seen[kind]
                self._seen[kind] += 1
            self._recording.append(PipelineEvent(kind, micro_batch, kwargs.get("buffer_id"), start, end, compute))

        return timed


class PipelineBackend(DeepSpeedEngineBackend):
    def __init__(self, model: torch.nn.Module, settings: BackendSettings):
        self._names = tensor_names(model)
        family, device, ds_config = settings.family, settings.device, settings.deepspeed_config
        self.family, self.device, self.input_dtype = family, device, settings.input_dtype
        self.hooks = settings.hooks
        partition_method = settings.pipeline_partition_method
        self.module = PipelineModule(
            layers=family.pipeline.layers(model),
            topology=settings.layout.topology(),
            loss_fn=self._training_loss,
            partition_method=f"type:{family.pipeline.block_type}" if partition_method == "type" else partition_method,
            activation_checkpoint_interval=settings.pipeline_activation_checkpoint_interval,
            activation_checkpoint_func=non_reentrant_checkpoint,
        )
        self._loss_head = self._take_head(settings.model_fields.get("loss"))
        self._vocab = settings.model_fields.get("vocab_size")
        self.grid = self.module.mpu()
        count_in_norm_once(self.module, self.grid.get_slice_parallel_rank())
        defer_norm_checks(settings)
        self.start_writer(settings)
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module,
            model_parameters=parameter_groups(
                self.module.parameters(), ds_config["optimizer"], settings.weight_decay_on
            ),
            config=ds_config,
        )
        self.write_in_background(settings)
        self._accumulation = self.engine.gradient_accumulation_steps()
        self._mixed_precision = self.engine.bfloat16_enabled() or self.engine.fp16_enabled()
        self.watch_gradients()
        self._instructions = InstructionTimer(self.engine, device)
        self._track_norm()
        optimizer_step = self.engine._INSTRUCTION_MAP[schedule.OptimizerStep]

        def measured_optimizer_step(engine: PipelineEngine, **kwargs: int) -> None:
            # After ReduceGrads and ReduceTiedGrads: every stage holds its reduced gradients.
            self._measure_norm()
            optimizer_step(engine, **kwargs)

        self.engine._INSTRUCTION_MAP[schedule.OptimizerStep] = measured_optimizer_step

    def _take_head(self, loss: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """model.loss "tiled" or "fused": the last stage's last layer, the head, leaves the stage's
        forward (which then ends at the final norm's hidden states) and computes the loss piece by
        piece from them instead, so no stage holds the whole logits. Its parameters stay the stage's:
        DeepSpeed still reduces them, ties them to the embedding and steps them. None elsewhere."""
        if loss not in ("tiled", "fused") or self.module.stage_id != self.module.num_stages - 1:
            return None
        head = self.module.forward_funcs[-1]
        self.module.forward_funcs[-1] = _hidden_states
        self._cross_entropy = logits_free_loss(loss)
        return head

    def _summed_loss(self, hidden: torch.Tensor, labels: torch.Tensor, divisor: torch.Tensor | None) -> torch.Tensor:
        return self._cross_entropy(self._loss_head, hidden, labels, self._vocab, divisor)

    def _training_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Losses exist on the last stage only, inside the schedule: the hooks see them here.
        if self._loss_head is None:
            return self.hooks.on_loss(self.family.pipeline.loss(outputs, labels))
        return self.hooks.on_loss(self._summed_loss(outputs, labels, None))

    def stage_layers(self) -> list[str]:
        """Each stage's layer range, for the start-up layout table."""
        parts = self.module.parts
        return [f"layers {parts[stage]}-{parts[stage + 1] - 1}" for stage in range(len(parts) - 1)]

    def _pipeline_batches(self, batches: Iterator[Batch], count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(count):
            yield self.family.pipeline.split_batch(to_device(next(batches), self.device, self.input_dtype))

    def _train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        # The steps the loop times (always the last one among them) are recorded instruction by instruction.
        if not self.timing:
            return self._train_batch(batches)
        return self._instructions.record(lambda: self._train_batch(batches))

    def timeline(self) -> list[PipelineEvent]:
        """This rank's instructions in the last timed step (the run's last step, at the end), on its own clock."""
        return list(self._instructions.events)

    def finish(self, output_dir: Path, write_line: Callable[[str], None]) -> None:
        """The last step's measured schedule: rank 0 writes it, its chart and the measured bubble."""
        grid = self.grid
        mine = RankTimeline(
            dist.get_rank(),
            grid.get_stage_id(),
            grid.get_data_parallel_rank(),
            grid.get_slice_parallel_rank(),
            self.timeline(),
            self.compute_samples(),
        )
        write_pipeline_timeline(mine, self._accumulation, output_dir, write_line)

    def compute_samples(self) -> dict[str, list[float]]:
        """This rank's forward and backward compute seconds over every recorded step."""
        return {kind: list(samples) for kind, samples in self._instructions.compute_samples.items()}

    def step_breakdown(self) -> dict[str, float] | None:
        """This stage's seconds of the last step in data loading, forward, backward, communication
        (sends and receives, waits included) and step (gradient reductions and the optimizer)."""
        return None if not self.timing else step_breakdown(self._instructions.events)

    def _train_batch(self, batches: Iterator[Batch]) -> torch.Tensor:
        # train_batch returns the step's loss averaged over the data-parallel replicas, on every stage.
        return self.engine.train_batch(self._pipeline_batches(batches, self._accumulation))

    def eval_sums(self, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
        batches = list(batches)
        keys = self.family.pipeline.eval_keys

        def stacked_sums(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            if self._loss_head is None:
                sums = self.family.pipeline.eval_sums(outputs, labels)
            else:
                loss_sum = self._summed_loss(outputs, labels, torch.ones((), device=outputs.device))
                sums = {"loss_sum": loss_sum.detach().double(), "tokens": (labels != IGNORE_INDEX).sum().double()}
            return torch.stack([sums[key].reshape(()).double() for key in keys])

        self.module.loss_fn = stacked_sums
        # The engine adds every forward's "loss" to the training total it keeps; start that afresh.
        self.engine.total_loss = None
        # With a monitor on, eval_batch would broadcast these sums as one scalar loss and log it; the
        # evaluation reaches the monitor through the engine's own record instead.
        monitoring, self.engine.monitor.enabled = self.engine.monitor.enabled, False
        try:
            outputs = self.engine.eval_batch(
                self._pipeline_batches(iter(batches), len(batches)),
                reduce_output=None,
                bcast_loss=False,
                num_micro_batches=len(batches),
            )
        finally:
            self.module.loss_fn = self._training_loss
            self.engine.total_loss = None
            self.engine.monitor.enabled = monitoring
        if self.engine.is_last_stage() and self.grid.get_slice_parallel_rank() == 0:
            return dict(zip(keys, sum(outputs), strict=True))
        # Only the last stage sees outputs, and its tensor shards all see the same ones.
        return {key: torch.zeros((), dtype=torch.float64, device=self.device) for key in keys}

    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor] | None:
        # zero_to_fp32 does not know pipeline layer files; the live ranks hold what `tag` saved.
        return gather_full_state(
            self.module,
            self._names,
            self.grid.get_slice_parallel_group(),
            is_writer=self.grid.get_data_parallel_rank() == 0 and self.grid.get_slice_parallel_rank() == 0,
            mixed_precision=self._mixed_precision,
            masters=fp16_optimizer_masters(self.engine.optimizer),
            device=self.device,
        )


def _hidden_states(hidden: torch.Tensor) -> torch.Tensor:
    """The head's place in the last stage's forward under a logits-free loss (`_take_head`)."""
    return hidden
