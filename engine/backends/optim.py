"""The optimizer and LR schedule a config's DeepSpeed keys describe, built on plain torch.

The accelerate backend trains with these, and the single-process reference of the tests does
too, so `optimizer` and `scheduler` mean the same thing under every backend. The schedules are
DeepSpeed's own classes (they wrap any torch optimizer).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime import lr_schedules
from torch import nn

from engine.config.rules import exempts_vectors


def parameter_groups(parameters: Iterable[nn.Parameter], section: dict[str, Any], scope: str) -> list[dict[str, Any]]:
    """The trainable parameters as optimizer groups. Scope "matrices" exempts every parameter of
    fewer than two dimensions (biases, LayerNorm and BatchNorm gains) from weight decay, as
    Megatron-LM, GPT-NeoX, nanoGPT and transformers' Trainer do: decay pulls a gain towards zero,
    not towards the identity it starts at. Without decay to exempt there is one group, so ZeRO
    flattens and pads the model as one buffer. DeepSpeed, ZeRO and torch all take these groups."""
    trainable = [p for p in parameters if p.requires_grad]
    if not exempts_vectors(section, scope):
        return [{"params": trainable}]
    matrices = [p for p in trainable if full_ndim(p) >= 2]
    vectors = [p for p in trainable if full_ndim(p) < 2]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def full_ndim(parameter: nn.Parameter) -> int:
    """Dimensions of the whole parameter: one built partitioned under ZeRO-3 holds an empty
    one-dimensional shard, and only DeepSpeed's `ds_shape` still tells a matrix from a gain."""
    return len(getattr(parameter, "ds_shape", parameter.shape))


def build_optimizer(
    section: dict[str, Any], parameters: list[dict[str, Any]], cpu_adam: bool = False, fused: bool | None = None
) -> torch.optim.Optimizer:
    """`parameters`: the groups of `parameter_groups`. DeepSpeed treats "Adam" as AdamW unless
    adam_w_mode is false; `cpu_adam` picks DeepSpeed's C++ CPU Adam, the one DeepSpeed runs under
    optimizer offload, and the only one here that reads `bias_correction` (the config refuses false
    where torch's Adam would step). `fused`: torch's fused Adam kernel, one launch per step for all
    tensors, as DeepSpeed's FusedAdam is; None takes the resolved `optimizer.params.fused` (true where
    the parameters are on a GPU). Without it torch picks its own kernel (foreach on a GPU)."""
    params = dict(section["params"])
    if section["type"] == "SGD":
        return torch.optim.SGD(parameters, **params)
    decoupled = section["type"] == "AdamW" or params.get("adam_w_mode", True)
    params.pop("adam_w_mode", None)
    params.pop("torch_adam", None)
    bias_correction = params.pop("bias_correction", True)
    configured = params.pop("fused", False)
    if cpu_adam:
        return DeepSpeedCPUAdam(parameters, adamw_mode=decoupled, bias_correction=bias_correction, **params)
    fused = configured if fused is None else fused
    if fused:
        params["fused"] = True
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(parameters, **params)


def build_scheduler(section: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> Any | None:
    if not section:
        return None
    return getattr(lr_schedules, section["type"])(optimizer, **section["params"])


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's hyperparameters as this run's config set them: taken before a checkpoint
    loads, for `restore_group_settings` to put back after it."""
    groups = optimizer.param_groups
    return [{key: value for key, value in group.items() if key not in ("params", "step")} for group in groups]


def restore_group_settings(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]], scheduler: Any) -> None:
    """The config's hyperparameters over the checkpoint's. torch's and DeepSpeed's loads restore each
    group's lr, betas, eps and decay as saved, so a resume with a lower optimizer.params.lr (what a
    loss spike calls for) would train on at the old one. The lr comes from the restored schedule
    where there is one (it counts from the config's values), else from the config. On an unchanged
    config this writes back exactly the values just loaded."""
    lrs = scheduler.get_lr() if scheduler is not None else [wanted["lr"] for wanted in settings]
    for group, wanted, lr in zip(optimizer.param_groups, settings, lrs, strict=True):
        group.update(wanted, lr=lr)
