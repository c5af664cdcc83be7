"""The parameters each pipeline stage holds, per tensor shard, worked out on the meta device: the
model is built without memory, its tensor-parallel shards are sized from the family's plan, and
its pipeline layers are cut into stages the way DeepSpeed's `PipelineModule` cuts them."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

import torch
from deepspeed.pipe import LayerSpec
from deepspeed.runtime.utils import partition_balanced, partition_uniform
from torch import nn

from engine.backends.optim import parameter_groups
from engine.config import EngineConfig
from models import ModelFamily
from models.lora import apply_lora
from parallelism.tensor_plan import TensorParallelPlan


def build_on_meta(family: ModelFamily, section: Mapping[str, Any]) -> nn.Module:
    """The model's shapes without its memory (a pretrained checkpoint has the configured shapes), with
    model.lora's adapters where it has them, its base frozen as training freezes it."""
    section = {key: value for key, value in section.items() if key != "init_from"}
    with torch.device("meta"):
        model = family.build(section)
        return model if section.get("lora") is None else apply_lora(model, section["lora"], seed=0)


def sharded_parameters(model: nn.Module, plan: TensorParallelPlan | None, tensor: int) -> set[int]:
    """Identities of the parameters `apply_tensor_parallel` splits across `tensor` ranks: every
    parameter of a column-parallel module, a row-parallel weight (its bias stays whole), the
    vocabulary embedding and the head (the same weight where they are tied)."""
    if plan is None or tensor == 1:
        return set()
    modules = dict(model.named_modules())

    def matching(pattern: str) -> list[nn.Module]:
        return [module for name, module in modules.items() if fnmatch.fnmatchcase(name, pattern)]

    split = {id(p) for pattern in plan.column for module in matching(pattern) for p in module.parameters()}
    split |= {id(module.weight) for pattern in plan.row for module in matching(pattern)}
    split.add(id(modules[plan.vocab_embedding].weight))
    split |= {id(p) for p in modules[plan.head].parameters()}
    return split


def local_numels(parameters: list[nn.Parameter], split: set[int], tensor: int) -> list[int]:
    """Trainable elements per parameter on one tensor shard; the plan's rules keep splits even."""
    return [p.numel() // tensor if id(p) in split else p.numel() for p in parameters if p.requires_grad]


def unique_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    ordered = []
    for module in modules:
        for parameter in module.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                ordered.append(parameter)
    return ordered


def stage_parameters(
    model: nn.Module, family: ModelFamily, stages: int, partition_method: str, split: set[int], tensor: int
) -> tuple[list[list[nn.Parameter]], list[int]]:
    """Each stage's parameters in the order its PipelineModule registers them, and the cut points:
    stage s holds layers `parts[s]` to `parts[s + 1] - 1`.

    pipe/module.py: `_partition_layers` balances parameter counts (`partition_balanced` over
    `_count_layer_params`), layer counts (`partition_uniform`) or the layers whose class matches
    the type (`type:` + the family's block pattern); `_build` registers the tied modules first
    (`tied_modules` is created before any layer), then the stage's other layers in order.
    """
    layers = family.pipeline.layers(model)
    built = [layer.build() if isinstance(layer, LayerSpec) else layer for layer in layers]
    if stages == 1:
        return [unique_parameters([model])], [0, len(layers)]
    if partition_method == "uniform":
        parts = partition_uniform(num_items=len(layers), num_parts=stages)
    elif partition_method == "type":
        # A regular expression searched in each class name, as DeepSpeed's `_find_layer_type` does.
        block = re.compile(family.pipeline.block_type, re.IGNORECASE)
        weights = [1 if block.search(type(module).__name__) else 0 for module in built]
        parts = partition_balanced(weights=weights, num_parts=stages)
    else:
        # Counted on the tensor shard, as the shard's PipelineModule counts them.
        counts = [sum(local_numels(list(module.parameters()), split, tensor)) for module in built]
        parts = partition_balanced(weights=counts, num_parts=stages)
    result = []
    for stage in range(stages):
        chosen = range(parts[stage], parts[stage + 1])
        tied: dict[str, nn.Module] = {}
        for index in chosen:
            key = getattr(layers[index], "key", None)
            if key is not None:
                tied.setdefault(key, built[index])
        others = [built[index] for index in chosen if getattr(layers[index], "key", None) is None]
        result.append(unique_parameters([*tied.values(), *others]))
    return result, list(parts)


def stage_numels(config: EngineConfig, family: ModelFamily) -> tuple[list[list[list[int]]], list[int], nn.Module]:
    """Per pipeline stage, the trainable element counts one tensor shard holds, per optimizer group
    (`engine.backends.optim.parameter_groups`), in flattening order; the stages' cut points; the meta model."""
    model = build_on_meta(family, config.model.fields)
    tensor = config.parallel.tensor_parallel_size
    split = sharded_parameters(model, family.tensor_parallel, tensor)
    stages, parts = stage_parameters(
        model,
        family,
        config.parallel.pipeline_parallel_size,
        config.parallel.pipeline_partition_method,
        split,
        tensor,
    )
    section, decay_on = config.document["optimizer"], config.trainer.weight_decay_on
    numels = [
        [local_numels(group["params"], split, tensor) for group in parameter_groups(parameters, section, decay_on)]
        for parameters in stages
    ]
    return numels, parts, model
