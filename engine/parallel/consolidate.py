"""Full fp32 weights of a model-parallel run, gathered from the live ranks for the export.

DeepSpeed's `zero_to_fp32` reads data-parallel checkpoints only: it knows neither how this
engine's tensor-parallel layers cut a weight nor which pipeline stage holds which layer. So a
tensor- or pipeline-parallel run gathers instead: each rank takes the fp32 value of its own
parameters (DeepSpeed's `safe_get_full_fp32_param` assembles ZeRO-1/2 partitions across the
data-parallel group), the tensor-parallel group joins its shards, and rank 0 collects one copy
of every stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn
from torch._utils import _unflatten_dense_tensors

from parallelism.tensor import SHARD_ATTRIBUTE, gather_tensor_parallel


def tensor_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's and persistent buffer's name in the unsplit model, keyed by tensor identity,
    so the pieces of it that pipeline stages hold can be named again at export."""
    names = {id(tensor): name for name, tensor in model.state_dict(keep_vars=True).items()}
    for name, parameter in model.named_parameters():
        names.setdefault(id(parameter), name)
    return names


def fp16_optimizer_masters(optimizer: object) -> dict[int, torch.Tensor]:
    """The fp32 masters of DeepSpeed's ZeRO-0 fp16/bf16 optimizers, by parameter identity, which
    they keep without the links ZeRO's accessor follows: FP16_UnfusedOptimizer one fp32 copy per
    parameter (`fp32_groups`), FP16_Optimizer one flat tensor per group (`fp32_groups_flat`, laid
    out as `_flatten_dense_tensors` lays out the group)."""
    groups = getattr(optimizer, "fp16_groups", None)
    attributes = vars(optimizer) if groups is not None else {}
    if not ("fp32_groups" in attributes or "fp32_groups_flat" in attributes):
        return {}
    parameters = [parameter for group in groups for parameter in group]
    masters = saved_fp16_optimizer_masters(attributes, groups)
    return {id(parameter): master for parameter, master in zip(parameters, masters, strict=True)}


def saved_fp16_optimizer_masters(state: Mapping[str, Any], groups: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The fp32 masters in a saved `state_dict()` of the same two optimizers (or in their attributes,
    which carry the same names), parameter by parameter in the order of `groups` (a tensor of each
    parameter's shape, group by group, as the groups were handed to `deepspeed.initialize`):
    FP16_UnfusedOptimizer's `fp32_groups` as they are, FP16_Optimizer's `fp32_groups_flat` cut back
    into the group's shapes."""
    if "fp32_groups" in state:
        return [master for group in state["fp32_groups"] for master in group]
    flats = zip(state["fp32_groups_flat"], groups, strict=True)
    return [master for flat, group in flats for master in _unflatten_dense_tensors(flat, group)]


def fp32_value(tensor: torch.Tensor, mixed_precision: bool, masters: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """The fp32 master of a parameter when an optimizer keeps one, else the tensor itself."""
    master = safe_get_full_fp32_param(tensor) if isinstance(tensor, nn.Parameter) else None
    if master is None:
        master = masters.get(id(tensor))
    if master is not None:
        return master.detach().float().cpu()
    if mixed_precision and isinstance(tensor, nn.Parameter):
        raise RuntimeError(
            "the optimizer keeps no fp32 master for a parameter of this model-parallel run, so the export "
            "cannot read full-precision weights"
        )
    value = tensor.detach().cpu()
    return value.float() if value.is_floating_point() else value


def gather_full_state(
    module: nn.Module,
    names: Mapping[int, str],
    tensor_group: dist.ProcessGroup | None,
    is_writer: bool,
    mixed_precision: bool,
    masters: Mapping[int, torch.Tensor],
    device: torch.device,
) -> dict[str, torch.Tensor] | None:
    """Rank 0's full state dict under the unsplit model's names; None on every other rank.

    Collective over the world. `is_writer` marks the one rank per pipeline stage (data replica 0,
    tensor shard 0) whose gathered stage is sent to rank 0; `masters` are fp32 masters that
    DeepSpeed's own accessor does not find (see `fp16_optimizer_masters`); `device` is the one the
    tensor-parallel group communicates on. The values themselves are gathered on the host.
    """
    local: dict[str, torch.Tensor] = {}
    shards = {}
    for tensor in module.state_dict(keep_vars=True).values():
        name = names.get(id(tensor))
        if name is None or name in local:
            continue
        local[name] = fp32_value(tensor, mixed_precision, masters)
        if hasattr(tensor, SHARD_ATTRIBUTE):
            shards[name] = getattr(tensor, SHARD_ATTRIBUTE)
    stage = gather_tensor_parallel(local, shards, tensor_group, device)
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.gather_object(stage if is_writer else None, parts if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, value in (part or {}).items():
            full.setdefault(name, value)
    return full
