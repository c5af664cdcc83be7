"""DeepSpeed's CPU Adam, resumed with the bias correction the uninterrupted run would have used.

The C++ optimizer behind `DeepSpeedCPUAdam` (csrc/includes/cpu_adam.h `IncrementStep`) keeps beta1^t
and beta2^t itself, outside any state dict: a step one past the last multiplies them by the betas
once more, any other step recomputes them with `pow`. A run that trains steps 1..k holds the
product b·b·…·b; a resumed one, whose C++ object is new, meets step k+1 first and takes pow(b, k+1),
which differs in the last bit, and so does every update after it (1e-6 in the loss four steps on).
Replaying steps 1..k on empty tensors before the first real one rebuilds the same products,
which makes a resume under optimizer offload (to the host or to NVMe) exact.
"""

from __future__ import annotations

from typing import Any

import torch


def replay_cpu_adam_steps(optimizer: Any) -> None:
    """Bring the C++ state of the `DeepSpeedCPUAdam` inside a ZeRO `optimizer` (if it runs one) to the
    step its loaded state dict is at."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, DeepSpeedCPUAdam):
        return
    steps = [int(state["step"]) for state in inner.state.values() if "step" in state]
    if not steps:
        return
    group = inner.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, max(steps) + 1):
        inner.ds_opt_adam.adam_update(
            inner.opt_id,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
            empty,
            empty,
            empty,
            empty,
        )
