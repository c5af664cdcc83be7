"""model.activation_checkpointing: which activations a model recomputes in the backward pass instead
of keeping them, and where it keeps those it still must. Each family's `parallelize` step applies it
first (models/parallelize.py; the function here for the decoders, models/resnet.py's for ResNet), the
planner counts it (engine/plan/) and `plan --suggest` tries it in `SUGGESTED` order.

The forms follow Megatron's and torchtitan's: whole blocks (every block, or every k-th, the others
keeping their activations), the attention of each block only (Megatron's selective recompute), and
the recomputed blocks' inputs offloaded to host memory (DeepSpeed's `cpu_checkpointing`, torch's
`save_on_cpu`, transformers' `offload`).

torch is imported by the functions that apply a choice: the config's checks read the choice
(`Checkpointing`) and must not pay for importing it.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The value model.activation_checkpointing takes: true, false, "attention" or {"every": k, "offload": b}.
ATTENTION = "attention"


@dataclass(frozen=True)
class Checkpointing:
    """One choice. `every`: the blocks recomputed whole are 0, k, 2k, ... (transformers' and
    torchtitan's count), 0 for none; `attention`: each block's attention module alone is recomputed;
    `offload`: what the recomputed blocks keep for the backward pass, their inputs, waits in host
    memory (pinned where CUDA is)."""

    every: int = 0
    attention: bool = False
    offload: bool = False

    @classmethod
    def of(cls, value: bool | str | Mapping[str, Any] | None) -> Checkpointing:
        """The choice a schema-valid model.activation_checkpointing names."""
        if value is None or value is False:
            return cls()
        if value is True:
            return cls(every=1)
        if value == ATTENTION:
            return cls(attention=True)
        return cls(every=value.get("every", 1), offload=value.get("offload", False))

    def __bool__(self) -> bool:
        return bool(self.every) or self.attention

    def recomputes(self, block: int) -> bool:
        """Whether block `block` (counted from 0) is recomputed whole."""
        return bool(self.every) and block % self.every == 0

    def recomputed(self, blocks: int) -> int:
        """How many of `blocks` consecutive blocks, the first counted as block 0, are recomputed whole."""
        return -(-blocks // self.every) if self.every else 0

    @property
    def value(self) -> bool | str | dict[str, Any]:
        """The config value naming this choice, as `--set model.activation_checkpointing=` takes it."""
        if self.attention:
            return ATTENTION
        if self.offload:
            return {"every": self.every, "offload": True}
        if self.every > 1:
            return {"every": self.every}
        return self.every == 1

    @property
    def label(self) -> str:
        if self.attention:
            return "attention only"
        if not self.every:
            return "off"
        blocks = "every block" if self.every == 1 else f"every {self.every} blocks"
        return f"{blocks}, inputs on host" if self.offload else blocks


NONE = Checkpointing()
EVERY_BLOCK = Checkpointing(every=1)

# `plan --suggest`'s order, least recompute first: it keeps the first that fits each layout.
# Attention alone recomputes its four projections and the scores, about a third of a block's
# forward FLOPs at GPT's widths (4h^2 of 12h^2 per token, plus the scores); every second block half
# of them; every block all of them; offloading adds two copies over PCIe per recomputed block to that.
SUGGESTED = (
    NONE,
    Checkpointing(attention=True),
    Checkpointing(every=2),
    EVERY_BLOCK,
    Checkpointing(every=1, offload=True),
)


def checkpoint_function(offload: bool) -> Callable[..., Any]:
    """torch's non-reentrant checkpoint, which inputs without gradients (token ids) and DeepSpeed's
    ZeRO-3 hooks (run again in the recomputation, gathering the weights again) both pass through.
    With `offload`, the inputs the checkpoint saves for its recomputation are packed into host memory
    by torch's `save_on_cpu`; within the checkpoint nothing else is saved. pin_memory asks for pinned
    buffers only where CUDA is (save_on_cpu's device check); on a CPU-only machine the copies are plain."""
    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import checkpoint

    plain = functools.partial(checkpoint, use_reentrant=False)
    if not offload:
        return plain

    def offloaded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=True):
            return plain(function, *args, **kwargs)

    return offloaded


def checkpoint_forward(module: torch.nn.Module) -> None:
    """Recompute `module` in the backward pass. Its `forward` is replaced on the instance, as a bound
    method (a deep copy of the model then recomputes its own module), so no parameter is renamed
    (DeepSpeed consolidates checkpoints by name, exports load into the plain model) and its hooks
    (ZeRO-3's, FSDP's) stay outside the checkpoint."""
    module.forward = types.MethodType(_checkpointed_forward, module)


def _checkpointed_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    import torch
    from torch.utils.checkpoint import checkpoint

    forward = type(module).forward
    # Without a backward pass to come (evaluation, no_grad) there is nothing to recompute.
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)
    return forward(module, *args, **kwargs)


# A decoder block's attention module: Llama's `self_attn`, GPT-2's `attn`.
_ATTENTION_NAMES = ("self_attn", "attn")


def apply_activation_checkpointing(model: torch.nn.Module, choice: Checkpointing = EVERY_BLOCK) -> None:
    """Recompute in a transformers decoder's (GPT's, Llama's) backward pass what `choice` names
    instead of keeping its activations, without renaming any parameter.

    Whole blocks: transformers' own switch, non-reentrant (it works with inputs that do not require
    grad, token ids, and with DeepSpeed's ZeRO hooks), then the per-block flag and checkpoint function
    that transformers' GradientCheckpointingLayer documents, for every k-th block and for offloading.
    Attention only: each block's attention module recomputes on its own (`checkpoint_forward`).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    if choice.attention:
        for block in blocks:
            checkpoint_forward(next(child for name, child in block.named_children() if name in _ATTENTION_NAMES))
        return
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for index, block in enumerate(blocks):
        block.gradient_checkpointing = choice.recomputes(index)
        block._gradient_checkpointing_func = checkpoint_function(choice.offload)
