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


def build_optimizer(
    section: dict[str, Any], parameters: Iterable[torch.nn.Parameter], cpu_adam: bool = False, fused: bool = False
) -> torch.optim.Optimizer:
    """DeepSpeed treats "Adam" as AdamW unless adam_w_mode is false; `cpu_adam` picks DeepSpeed's
    C++ CPU Adam, the one DeepSpeed runs under optimizer offload. `fused`: torch's fused Adam kernel
    (for parameters on a GPU), one launch per step for all tensors, as DeepSpeed's FusedAdam is there."""
    params = dict(section["params"])
    if section["type"] == "SGD":
        return torch.optim.SGD(parameters, **params)
    decoupled = section["type"] == "AdamW" or params.get("adam_w_mode", True)
    params.pop("adam_w_mode", None)
    params.pop("torch_adam", None)
    if cpu_adam:
        return DeepSpeedCPUAdam(parameters, adamw_mode=decoupled, **params)
    if fused:
        params["fused"] = True
    return (torch.optim.AdamW if decoupled else torch.optim.Adam)(parameters, **params)


def build_scheduler(section: dict[str, Any] | None, optimizer: torch.optim.Optimizer) -> Any | None:
    if not section:
        return None
    return getattr(lr_schedules, section["type"])(optimizer, **section["params"])
