"""DeepSpeed's pipeline engine as a backend: the model's layers cut into stages
(`deepspeed.pipe.PipelineModule`), each step one `train_batch` that runs DeepSpeed's 1F1B schedule
over the step's micro-batches (the config's gradient_accumulation_steps).

The family supplies the layer list, how a batch splits into the first stage's input and the last
stage's labels, and the losses; DeepSpeed does the scheduling, the activation and gradient
transfers between stages, and keeps tied weights (GPT's embedding and head) equal across stages.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint

from engine.backends.base import Batch, to_device
from engine.backends.deepspeed_backend import DeepSpeedEngineBackend
from engine.parallel.consolidate import fp16_optimizer_masters, gather_full_state, tensor_names
from engine.parallel.layout import ParallelLayout
from models import ModelFamily


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


class PipelineBackend(DeepSpeedEngineBackend):
    def __init__(
        self,
        model: torch.nn.Module,
        family: ModelFamily,
        ds_config: dict[str, Any],
        device: torch.device,
        input_dtype: torch.dtype,
        layout: ParallelLayout,
        partition_method: str,
        activation_checkpoint_interval: int,
    ):
        self._names = tensor_names(model)
        self.family, self.device, self.input_dtype = family, device, input_dtype
        self.module = PipelineModule(
            layers=family.pipeline.layers(model),
            topology=layout.topology(),
            loss_fn=family.pipeline.loss,
            partition_method=f"type:{family.pipeline.block_type}" if partition_method == "type" else partition_method,
            activation_checkpoint_interval=activation_checkpoint_interval,
            activation_checkpoint_func=non_reentrant_checkpoint,
        )
        self.grid = self.module.mpu()
        count_in_norm_once(self.module, self.grid.get_slice_parallel_rank())
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.module,
            model_parameters=[p for p in self.module.parameters() if p.requires_grad],
            config=ds_config,
        )
        self._accumulation = self.engine.gradient_accumulation_steps()
        self._mixed_precision = self.engine.bfloat16_enabled() or self.engine.fp16_enabled()

    def stage_layers(self) -> list[str]:
        """Each stage's layer range, for the start-up layout table."""
        parts = self.module.parts
        return [f"layers {parts[stage]}-{parts[stage + 1] - 1}" for stage in range(len(parts) - 1)]

    def _pipeline_batches(self, batches: Iterator[Batch], count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(count):
            yield self.family.pipeline.split_batch(to_device(next(batches), self.device, self.input_dtype))

    def train_step(self, batches: Iterator[Batch]) -> torch.Tensor:
        # train_batch returns the step's loss averaged over the data-parallel replicas, on every stage.
        if self.loss_hook is None:
            return self.engine.train_batch(self._pipeline_batches(batches, self._accumulation))
        # Losses exist on the last stage only, inside the schedule: the hook goes into the loss function.
        hook, loss = self.loss_hook, self.family.pipeline.loss
        self.module.loss_fn = lambda outputs, labels: hook(loss(outputs, labels))
        try:
            return self.engine.train_batch(self._pipeline_batches(batches, self._accumulation))
        finally:
            self.module.loss_fn = loss

    def eval_sums(self, batches: Iterable[Batch]) -> dict[str, torch.Tensor]:
        batches = list(batches)
        keys = self.family.pipeline.eval_keys

        def stacked_sums(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            sums = self.family.pipeline.eval_sums(outputs, labels)
            return torch.stack([sums[key].reshape(()).double() for key in keys])

        self.module.loss_fn = stacked_sums
        # The engine adds every forward's "loss" to the training total it keeps; start that afresh.
        self.engine.total_loss = None
        try:
            outputs = self.engine.eval_batch(
                self._pipeline_batches(iter(batches), len(batches)),
                reduce_output=None,
                bcast_loss=False,
                num_micro_batches=len(batches),
            )
        finally:
            self.module.loss_fn = self.family.pipeline.loss
            self.engine.total_loss = None
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
        )
