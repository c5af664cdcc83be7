"""One entry per model family: its presets, builder, loss, evaluation, export and parallel forms.

Adding a family means writing one module that exposes the names `_family` reads, and adding it
to `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import torch

from models import gpt, resnet
from models.tensor_parallel import TensorParallelPlan

Batch = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class PipelineForm:
    """A family as DeepSpeed pipeline layers.

    `layers` turns a built model into the layer list of a `PipelineModule`; `split_batch` makes a
    loader batch into (first stage's input, last stage's labels); `loss` and `eval_sums` (whose keys
    `eval_keys` names) run on the last stage's output. `block_type` is the class-name pattern that
    partition method "type" balances; `num_blocks` counts those blocks for an architecture.
    """

    layers: Callable[[torch.nn.Module], list]
    split_batch: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    eval_keys: tuple[str, ...]
    block_type: str
    num_blocks: Callable[[Mapping[str, Any]], int]


@dataclass(frozen=True)
class ModelFamily:
    """What the engine needs from a model family.

    `compute_loss` and `eval_sums` receive the module itself or a wrapper that forwards calls to it
    (a DeepSpeed engine), so they only call the model and never reach into its attributes.
    `check_init_from` reads what `model.init_from` names without loading its weights, so a wrong
    one stops the run before any process group.
    `tensor_parallel` is None for a family that cannot be split by layer; `shard_units` lists the
    repeating blocks: FSDP wraps them one by one, and the accelerate backend compiles them so.
    `builds_partitioned`: `build` honours transformers' ZeRO-3 integration, so under ZeRO-3 each rank
    only ever holds its share of the weights (engine/parallel/zero3_init.py).
    """

    name: str
    presets: Mapping[str, Mapping[str, Any]]
    architecture: Callable[[Mapping[str, Any]], dict[str, Any]]
    build: Callable[[Mapping[str, Any]], torch.nn.Module]
    check_init_from: Callable[[Mapping[str, Any]], None]
    compute_loss: Callable[[torch.nn.Module, Batch], torch.Tensor]
    eval_sums: Callable[[torch.nn.Module, Batch], dict[str, torch.Tensor]]
    summarize_eval: Callable[[Mapping[str, float]], dict[str, float]]
    export: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], Path], None]
    load_export: Callable[[Path], torch.nn.Module]
    pipeline: PipelineForm
    tensor_parallel: TensorParallelPlan | None
    shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]]
    builds_partitioned: bool


def _family(name: str, module: ModuleType) -> ModelFamily:
    """Every family module exposes the same names, so registering one takes a single line."""
    return ModelFamily(
        name=name,
        presets=MappingProxyType(module.PRESETS),
        architecture=module.architecture,
        build=module.build,
        check_init_from=module.check_init_from,
        compute_loss=module.compute_loss,
        eval_sums=module.eval_sums,
        summarize_eval=module.summarize_eval,
        export=module.export,
        load_export=module.load_export,
        pipeline=PipelineForm(
            layers=module.pipeline_layers,
            split_batch=module.pipeline_batch,
            loss=module.pipeline_loss,
            eval_sums=module.pipeline_eval_sums,
            eval_keys=module.EVAL_SUMS,
            block_type=module.PIPELINE_BLOCK_TYPE,
            num_blocks=module.pipeline_blocks,
        ),
        tensor_parallel=getattr(module, "TENSOR_PARALLEL_PLAN", None),
        shard_units=module.shard_units,
        builds_partitioned=module.BUILDS_PARTITIONED,
    )


FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {"gpt": _family("gpt", gpt), "resnet": _family("resnet", resnet)}
)


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"model.family {name!r} is unknown; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]
