"""Which backend a config gets, and the model-parallel set-up that must happen before it exists.

`trainer.backend` (resolved from the launcher when "auto") picks accelerate or DeepSpeed. For
DeepSpeed the order matters and is the same on every rank: build the full model from the seed (under
ZeRO-3, already partitioned where the family allows it), cut it into tensor-parallel shards, then hand
it to DeepSpeed, either whole (data and tensor parallelism) or as pipeline layers.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from deepspeed.runtime.pipe.topology import PipelineParallelGrid

from engine.backends.base import Backend
from engine.backends.deepspeed_backend import DeepSpeedBackend, DeepSpeedEngineBackend
from engine.backends.pipeline_backend import PipelineBackend
from engine.config import EngineConfig
from engine.parallel.layout import parallel_layout
from engine.parallel.zero3_init import partitioned_build
from models import ModelFamily
from models.tensor_parallel import apply_tensor_parallel


def build_backend(
    config: EngineConfig,
    family: ModelFamily,
    device: torch.device,
    input_dtype: torch.dtype,
    load_universal: bool = False,
) -> tuple[Backend, int]:
    """The backend and this rank's data-parallel index (which shard of each batch it reads).

    The caller has seeded every rank alike, so `family.build` gives every rank the same weights.
    `load_universal`: the run resumes from a universal checkpoint (DeepSpeed decides at
    initialisation how its optimizer will load; the accelerate backend converts it as it loads).
    """
    if config.trainer["backend"] == "accelerate":
        # Imported only here: accelerate with torch's FSDP and distributed checkpointing would add
        # about 2 s to the start-up of every DeepSpeed rank.
        from engine.backends.accelerate_backend import AccelerateBackend

        return AccelerateBackend(family.build(config.model), family, config, device), torch.distributed.get_rank()
    ds_config = config.deepspeed_config()
    if load_universal:
        ds_config["checkpoint"] = {"load_universal": True}
    partitioned = config.zero_stage == 3 and family.builds_partitioned
    with partitioned_build(ds_config) if partitioned else nullcontext():
        model = family.build(config.model)
    backend, data_rank = _deepspeed_backend(model, family, config, ds_config, device, input_dtype)
    if config.trainer["compile"]:
        backend.compile()
    return backend, data_rank


def _deepspeed_backend(
    model: torch.nn.Module,
    family: ModelFamily,
    config: EngineConfig,
    ds_config: dict,
    device: torch.device,
    input_dtype: torch.dtype,
) -> tuple[DeepSpeedEngineBackend, int]:
    layout = parallel_layout(config)
    decay_on = config.trainer["weight_decay_on"]
    if not layout.model_parallel:
        backend = DeepSpeedBackend(model, family, ds_config, device, input_dtype, decay_on)
        return backend, torch.distributed.get_rank()
    # DeepSpeed's grid creates the data-, tensor- and pipeline-parallel groups from the topology.
    grid = PipelineParallelGrid(topology=layout.topology())
    if layout.tensor > 1:
        apply_tensor_parallel(model, family.tensor_parallel, grid.get_slice_parallel_group())
    if layout.pipeline == 1:
        backend = DeepSpeedBackend(model, family, ds_config, device, input_dtype, decay_on, grid=grid)
    else:
        backend = PipelineBackend(
            model,
            family,
            ds_config,
            device,
            input_dtype,
            layout,
            partition_method=config.parallel["pipeline_partition_method"],
            activation_checkpoint_interval=config.parallel["pipeline_activation_checkpoint_interval"],
            weight_decay_on=decay_on,
        )
    return backend, grid.get_data_parallel_rank()
