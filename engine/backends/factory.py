"""Which backend a config gets, and the model-parallel set-up that must happen before it exists.

`trainer.backend` (resolved from the launcher when "auto") picks accelerate or DeepSpeed. For
DeepSpeed the order matters and is the same on every rank: build the full model from the seed (under
ZeRO-3, already partitioned where the family allows it), cut it into tensor-parallel shards, then hand
it to DeepSpeed, either whole (data and tensor parallelism) or as pipeline layers.
"""

from __future__ import annotations

import copy
import dataclasses
from contextlib import nullcontext

import torch
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from engine.backends.base import Backend, BackendSettings, StepHooks
from engine.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedEngineBackend
from engine.backends.nvme_repairs import repair_swappers
from engine.backends.pipeline_backend import PipelineBackend
from engine.config.rules import labels_can_be_masked
from engine.parallel.sequence import enable_ulysses
from engine.parallel.zero3_init import partition_built, partitioned_build
from engine.run_description import RunDescription
from models import ModelFamily
from models.lora import apply_lora
from parallelism.tensor import apply_tensor_parallel

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def backend_settings(
    description: RunDescription, family: ModelFamily, device: torch.device, hooks: StepHooks
) -> BackendSettings:
    """What every backend is built from: the run's description as the backends read it."""
    config = description.config
    return BackendSettings(
        backend=config.trainer.backend,
        family=family,
        model_fields=config.model.fields,
        device=device,
        input_dtype=_DTYPES[config.precision],
        deepspeed_config=copy.deepcopy(description.deepspeed_config),
        batch=description.batch,
        precision=config.precision,
        weight_decay_on=config.trainer.weight_decay_on,
        zero_stage=config.zero_stage,
        accelerate_wrapper=config.accelerate_wrapper,
        layout=description.layout,
        pipeline_partition_method=config.parallel.pipeline_partition_method,
        pipeline_activation_checkpoint_interval=config.parallel.pipeline_activation_checkpoint_interval,
        hooks=hooks,
        compile=config.trainer.compile,
        nonfinite=config.trainer.nonfinite,
        async_save=config.trainer.async_save,
        masked_labels=labels_can_be_masked(config.data.as_mapping()),
        seed=config.trainer.seed,
    )


def build_backend(settings: BackendSettings) -> tuple[Backend, int]:
    """The backend and this rank's data-parallel index (which shard of each batch it reads).

    The caller has seeded every rank alike, so `family.build` gives every rank the same weights.
    """
    family = settings.family
    if settings.backend == "accelerate":
        # Imported only here: accelerate with torch's FSDP and distributed checkpointing would add
        # about 2 s to the start-up of every DeepSpeed rank.
        from engine.backends.accelerate_backend import AccelerateBackend

        model = with_adapters(family.build(settings.model_fields), settings)
        return AccelerateBackend(model, settings), torch.distributed.get_rank()
    zero = settings.deepspeed_config["zero_optimization"]
    swaps_parameters = zero.get("offload_param", {}).get("device") == "nvme"
    if swaps_parameters or zero.get("offload_optimizer", {}).get("device") == "nvme":
        repair_swappers()
    partitioned = settings.zero_stage == 3 and family.builds_partitioned
    with partitioned_build(settings.deepspeed_config) if partitioned else nullcontext():
        model = family.build(settings.model_fields)
    # Outside the partitioned build: deepspeed.initialize partitions the adapters it finds whole,
    # broadcasting rank 0's (parameter_offload.py `_convert_to_zero_parameters`).
    model = with_adapters(model, settings)
    if swaps_parameters and not partitioned:
        partition_built(model, settings.deepspeed_config)
    backend, data_rank = _deepspeed_backend(model, settings)
    if settings.compile:
        backend.compile()
    return backend, data_rank


def with_adapters(model: torch.nn.Module, settings: BackendSettings) -> torch.nn.Module:
    """`model` with model.lora's adapters, its base frozen (models/lora.py); `model` itself without."""
    section = settings.model_fields.get("lora")
    return model if section is None else apply_lora(model, section, settings.seed)


def _deepspeed_backend(model: torch.nn.Module, settings: BackendSettings) -> tuple[DeepSpeedEngineBackend, int]:
    layout = settings.layout
    if layout.sequence > 1:
        micro_batch = settings.batch.micro_batch_size
        shards = enable_ulysses(model, layout.sequence, micro_batch, settings.zero_stage)
        # The ranks of one sequence-parallel group read their data replica's batches.
        return DeepSpeedBackend(model, settings, shards), torch.distributed.get_rank() // layout.sequence
    if not layout.model_parallel:
        return DeepSpeedBackend(model, settings), torch.distributed.get_rank()
    # DeepSpeed's grid creates the data-, tensor- and pipeline-parallel groups from the topology.
    grid = PipelineParallelGrid(topology=layout.topology())
    if layout.tensor > 1:
        apply_tensor_parallel(model, settings.family.tensor_parallel, grid.get_slice_parallel_group())
    if layout.pipeline == 1:
        backend = DeepSpeedBackend(model, dataclasses.replace(settings, grid=grid))
    else:
        backend = PipelineBackend(model, settings)
    return backend, grid.get_data_parallel_rank()
