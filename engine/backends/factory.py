"""Which backend a config gets, and the model-parallel set-up that must happen before it exists.

`trainer.backend` (resolved from the launcher when "auto") picks accelerate or DeepSpeed. The order
is the same on every rank: build the full model from the seed (for DeepSpeed under ZeRO-3, already
partitioned where the family allows it), create DeepSpeed's parallel groups, then the family's
`parallelize` step (models/parallelize.py) checkpoints, adapts, cuts into tensor-parallel shards and
compiles it as the run asks, and ends in the backend's wrapping: DeepSpeed's engine over the whole
model (data, tensor or sequence parallelism) or over pipeline layers, or accelerate's DDP or FSDP2.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import nullcontext

import torch
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from engine.backends.base import Backend, BackendSettings
from engine.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedEngineBackend
from engine.backends.nvme_repairs import repair_swappers
from engine.backends.pipeline_backend import PipelineBackend
from engine.parallel.sequence import enable_ulysses
from engine.parallel.zero3_init import partition_built, partitioned_build
from models.activation_checkpointing import Checkpointing
from models.parallelize import Compile, ParallelRequest


def build_backend(settings: BackendSettings) -> tuple[Backend, int]:
    """The backend and this rank's data-parallel index (which shard of each batch it reads).

    The caller has seeded every rank alike, so `family.build` gives every rank the same weights;
    the family's `parallelize` step then gives the model the run's parallel form, ending in the
    backend's own wrapping (models/parallelize.py has the order and why).
    """
    family = settings.family
    if settings.backend == "accelerate":
        # Imported only here: accelerate with torch's FSDP and distributed checkpointing would add
        # about 2 s to the start-up of every DeepSpeed rank.
        from engine.backends.accelerate_backend import AccelerateBackend

        model = family.build(settings.model_fields)
        compiles = Compile.BLOCKS if settings.compile else Compile.OFF
        wrap = functools.partial(AccelerateBackend, settings=settings)
        backend = family.parallelize(model, _request(settings, compiles, wrap))
        return backend, torch.distributed.get_rank()
    zero = settings.deepspeed_config["zero_optimization"]
    swaps_parameters = zero.get("offload_param", {}).get("device") == "nvme"
    if swaps_parameters or zero.get("offload_optimizer", {}).get("device") == "nvme":
        repair_swappers()
    partitioned = settings.zero_stage == 3 and family.builds_partitioned
    with partitioned_build(settings.deepspeed_config) if partitioned else nullcontext():
        model = family.build(settings.model_fields)
    # The adapters come after the partitioned build, in `parallelize`: deepspeed.initialize partitions
    # the adapters it finds whole, broadcasting rank 0's (parameter_offload.py `_convert_to_zero_parameters`).
    layout = settings.layout
    # DeepSpeed's grid creates the data-, tensor- and pipeline-parallel groups from the topology.
    grid = PipelineParallelGrid(topology=layout.topology()) if layout.sequence == 1 and layout.model_parallel else None
    wrap = _deepspeed_wrapping(settings, grid, partition=swaps_parameters and not partitioned)
    tensor_group = grid.get_slice_parallel_group() if grid is not None and layout.tensor > 1 else None
    compiles = Compile.WRAPPED if settings.compile else Compile.OFF
    backend = family.parallelize(model, _request(settings, compiles, wrap, tensor_group))
    if layout.sequence > 1:
        # The ranks of one sequence-parallel group read their data replica's batches.
        return backend, torch.distributed.get_rank() // layout.sequence
    return backend, torch.distributed.get_rank() if grid is None else grid.get_data_parallel_rank()


def _request(
    settings: BackendSettings,
    compiles: Compile,
    wrap: Callable[[torch.nn.Module], Backend],
    tensor_group: torch.distributed.ProcessGroup | None = None,
) -> ParallelRequest:
    """What the run asks of the family's `parallelize` step, ending in `wrap`, the backend."""
    return ParallelRequest(
        checkpointing=Checkpointing.of(settings.model_fields.get("activation_checkpointing")),
        lora=settings.model_fields.get("lora"),
        seed=settings.seed,
        tensor_group=tensor_group,
        compile=compiles,
        wrap=wrap,
    )


def _deepspeed_wrapping(
    settings: BackendSettings, grid: PipelineParallelGrid | None, partition: bool
) -> Callable[[torch.nn.Module], DeepSpeedEngineBackend]:
    """The data-parallel wrapping the layout asks of DeepSpeed: its engine over the whole model
    (data, tensor or sequence parallelism) or over pipeline layers. `partition`: the model was built
    whole and its parameters swap to NVMe, so it is partitioned first as ZeRO-3 would."""
    layout = settings.layout

    def wrap(model: torch.nn.Module) -> DeepSpeedEngineBackend:
        if partition:
            partition_built(model, settings.deepspeed_config)
        if layout.sequence > 1:
            micro_batch = settings.batch.micro_batch_size
            shards = enable_ulysses(model, layout.sequence, micro_batch, settings.zero_stage)
            return DeepSpeedBackend(model, settings, shards)
        if grid is None:
            return DeepSpeedBackend(model, settings)
        if layout.pipeline == 1:
            return DeepSpeedBackend(model, dataclasses.replace(settings, grid=grid))
        return PipelineBackend(model, settings)

    return wrap
