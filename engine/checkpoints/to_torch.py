"""A DeepSpeed checkpoint as torch's full state dicts, for the accelerate backend to resume.

The universal form of a DeepSpeed checkpoint (`engine/checkpoints/universal.py`) holds every
parameter whole, in fp32, beside its Adam moments and step, whatever ZeRO stage, tensor or pipeline
split saved it: exactly what torch's `set_state_dict(..., full_state_dict=True)` takes, and cuts
into whatever this run holds (FSDP2's row pieces, DDP's whole tensors). The persistent buffers,
which the conversion leaves out, come from the saved module states (`universal.saved_buffers`),
the LR schedule and client state from DeepSpeed's engine state.

One rank reads the tensors (`full_state`) and torch broadcasts them one by one: were every rank to
read them, a node would hold the whole model and both Adam moments once per rank in host memory.
That rank maps the files instead of reading them: each tensor is paged in as torch sends it, and
the pages stay the kernel's to drop (copy-on-write, should the run write to one it keeps).
Every rank reads the schedule and client state (`progress`), memory-mapped, so the whole weights
DeepSpeed keeps beside them in the same file are never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepspeed.checkpoint.constants import PARAM
from torch import nn

from engine.checkpoints.universal import UNIVERSAL_FOLDER, ZERO3_PREFIX, saved_buffers, saved_names
from engine.parallel.consolidate import tensor_names
from models.module_state import persistent_buffers

# What DeepSpeed's own `load_checkpoint` keeps out of the client state it returns.
_DEEPSPEED_STATES = {
    "module",
    "skipped_steps",
    "global_steps",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "lr_scheduler",
    "optimizer",
}
# Taken from the checkpoint's groups: what a schedule may have moved. How the loading optimizer runs
# (foreach, fused) stays its own.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


@dataclass
class FullState:
    model: dict[str, torch.Tensor]  # full tensors under the loading model's names
    optimizer: dict[str, Any]  # torch's full optimizer state dict: {"state", "param_groups"} by name


@dataclass
class Progress:
    scheduler: dict[str, Any] | None
    client: dict[str, Any]


def full_state(tag_dir: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """The tensors of checkpoint `tag_dir`, already converted to its universal form, for `model`
    (not wrapped: its own names) and its torch `optimizer`, both as this run built them."""
    universal_dir = tag_dir / UNIVERSAL_FOLDER
    names = tensor_names(model)
    saved_as = {canonical: local for local, canonical in saved_names(tag_dir).items()}
    parameter_names = {id(parameter): name for name, parameter in model.named_parameters()}
    tensors = model.state_dict(keep_vars=True)
    buffers = saved_buffers(tag_dir, [names[id(buffer)] for buffer in persistent_buffers(model).values()])
    model_state: dict[str, torch.Tensor] = {}
    adam_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if id(tensor) not in parameter_names:
            model_state[name] = buffers[names[id(tensor)]]
            continue
        local = saved_as.get(names[id(tensor)], names[id(tensor)])
        folder = universal_dir / "zero" / local
        if not folder.is_dir():
            raise KeyError(f"universal checkpoint {universal_dir} holds no parameter {local!r} for {name!r}")
        model_state[name] = _read(folder / "fp32.pt", tensor.shape)
        adam_state[parameter_names[id(tensor)]] = {
            "step": torch.load(folder / "step.pt", weights_only=False),
            "exp_avg": _read(folder / "exp_avg.pt", tensor.shape),
            "exp_avg_sq": _read(folder / "exp_avg_sq.pt", tensor.shape),
        }
    saved_groups = torch.load(universal_dir / "zero" / "optimizer_state.pt", weights_only=False)["param_groups"]
    groups = [
        {
            **group,
            **{key: saved_group[key] for key in _HYPERPARAMETERS},
            "params": [parameter_names[id(p)] for p in group["params"]],
        }
        for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True)
    ]
    return FullState(model_state, {"state": adam_state, "param_groups": groups})


def progress(tag_dir: Path) -> Progress:
    """The LR schedule and client state of checkpoint `tag_dir`, from DeepSpeed's engine state."""
    engine_state = _engine_state(tag_dir / UNIVERSAL_FOLDER)
    client = {key: value for key, value in engine_state.items() if key not in _DEEPSPEED_STATES}
    return Progress(engine_state["lr_scheduler"], client)


def _read(path: Path, shape: torch.Size) -> torch.Tensor:
    """One state of a parameter, shaped as the parameter: a ZeRO-3 conversion keeps it flat."""
    return torch.load(path, weights_only=False, mmap=True)[PARAM].view(shape)


def _engine_state(universal_dir: Path) -> dict[str, Any]:
    """DeepSpeed's engine state of the saving run: `mp_rank_00_model_states.pt`, under ZeRO-3 the
    same with ZeRO-3's prefix. Mapped, not read: it holds the saving run's whole weights too."""
    for name in ("mp_rank_00_model_states.pt", ZERO3_PREFIX + "mp_rank_00_model_states.pt"):
        if (universal_dir / name).is_file():
            return torch.load(universal_dir / name, map_location="cpu", weights_only=False, mmap=True)
    raise FileNotFoundError(f"universal checkpoint {universal_dir} has no mp_rank_00 model states")
