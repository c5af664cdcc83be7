"""Each family's `parallelize` step: the one place that turns the model a family builds (plain, for one
device) into the form a run trains, in one order that reads top to bottom, as torchtitan's
`parallelize_llama` does.

The order, and why it is this one:

1. Activation checkpointing (`model.activation_checkpointing`). First, as the runs always had it:
   transformers' switch hooks the input embedding it finds then (its output made to require grad,
   for a frozen embedding's sake), which tensor parallelism would replace, and peft prepares a model
   already checkpointed for its adapters (peft_model.py `_prepare_model_for_gradient_checkpointing`).
2. LoRA adapters (`model.lora`, models/lora.py). Refused beside tensor and pipeline parallelism
   (engine/config/rules.py), so they never meet the tensor-parallel layers.
3. Tensor parallelism over the run's tensor-parallel group (parallelism/tensor.py).
4. Compile, block by block (torchtitan's order, for DDP and FSDP2): before any wrapper, so that
   identical blocks share one graph and the wrappers' hooks stay outside it.
5. The data-parallel wrapping. The wrappers are their authors' own objects (`deepspeed.initialize`,
   DeepSpeed's `PipelineModule`, accelerate's DDP, torch's FSDP2), built in a backend's constructor:
   the request carries the backend's constructor as `wrap`, and the step returns what it made.
6. Compile of the wrapped engine instead of 4 where its owner compiles after wrapping
   (`DeepSpeedEngine.compile()`: the whole module, or each of a pipeline stage's layers).

A family names its step in one line (`parallelize = ...`), binding its own checkpointing, its
tensor-parallel plan and its blocks; the engine's backend factory asks for the rest through
`ParallelRequest` (engine/backends/factory.py).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from models.activation_checkpointing import NONE, Checkpointing, apply_activation_checkpointing
from models.lora import apply_lora
from parallelism.tensor import TensorParallelPlan, apply_tensor_parallel

if TYPE_CHECKING:
    import torch.distributed as dist


class Compile(enum.Enum):
    """Where `trainer.compile` compiles (steps 4 and 6 of the module docstring)."""

    OFF = "off"
    BLOCKS = "blocks"
    WRAPPED = "wrapped"


class Compilable(Protocol):
    """What step 6 asks of the wrapped model: a module, or a DeepSpeed backend holding its engine."""

    def compile(self) -> None: ...


Wrapped = TypeVar("Wrapped", bound=Compilable)


def as_built(model: nn.Module) -> nn.Module:
    """No data-parallel wrapper: the model itself (one process, a reference, a benchmark's loop)."""
    return model


@dataclass(frozen=True)
class ParallelRequest(Generic[Wrapped]):
    """What a run asks of its model's parallel form. `tensor_group`: the group tensor parallelism
    splits the model across, None for none; `lora`: a model.lora section, with `seed` for its
    adapters' initial draws; `wrap`: the data-parallel wrapper's constructor."""

    checkpointing: Checkpointing = NONE
    lora: Mapping[str, Any] | None = None
    seed: int = 0
    tensor_group: dist.ProcessGroup | None = None
    compile: Compile = Compile.OFF
    wrap: Callable[[nn.Module], Wrapped] = as_built


def parallelize_model(
    model: nn.Module,
    request: ParallelRequest[Wrapped],
    *,
    checkpoint: Callable[[nn.Module, Checkpointing], None],
    tensor_parallel: TensorParallelPlan | None,
    blocks: Callable[[nn.Module], list[nn.Module]],
) -> Wrapped:
    """`model` in the form `request` asks for, in the module docstring's order. `checkpoint` applies
    the family's activation checkpointing, `tensor_parallel` is its plan (None: it has none),
    `blocks` lists its repeating blocks (what FSDP2 shards one by one and step 4 compiles)."""
    if request.checkpointing:
        checkpoint(model, request.checkpointing)
    if request.lora is not None:
        model = apply_lora(model, request.lora, request.seed)
    if request.tensor_group is not None:
        if tensor_parallel is None:
            raise ValueError(f"a {type(model).__name__} has no tensor-parallel form")
        apply_tensor_parallel(model, tensor_parallel, request.tensor_group)
    if request.compile is Compile.BLOCKS:
        for block in blocks(model):
            block.compile()
        if hasattr(model, "loss_function"):
            # transformers' loss, which the model computes in its forward (models/loss.py
            # compute_loss): compiled, its fp32 upcast and cross-entropy fuse instead of writing
            # fp32 logits, while the root module stays eager around the wrappers' hooks.
            model.loss_function = torch.compile(model.loss_function)
    wrapped = request.wrap(model)
    if request.compile is Compile.WRAPPED:
        wrapped.compile()
    return wrapped


# GPT and the Llama-shaped decoders: transformers' checkpointing switch (models/activation_checkpointing.py).
parallelize_decoder = functools.partial(parallelize_model, checkpoint=apply_activation_checkpointing)
