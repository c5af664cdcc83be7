"""An accelerate-backend checkpoint in DeepSpeed's universal form, for the DeepSpeed backend to resume.

The accelerate backend saves torch distributed checkpoints of `get_state_dict`: whole tensors
under DDP, FSDP2's row pieces as DTensors. torch's `dcp_to_torch_save` joins them into full tensors
in one process, which are what a universal checkpoint holds per parameter: the fp32 weight, Adam's
moments and step, each in the `{"param": tensor}` form `ds_to_universal` writes. Around them go the
two files DeepSpeed's universal loader reads besides: the optimizer's common state (DeepSpeed
version and group hyperparameters) and the engine state (`mp_rank_00_model_states.pt`: LR
schedule, step counters and client state, and the module state whose buffers
`universal.saved_buffers` reads). `checkpoint.load_universal` then cuts this like any conversion.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.checkpoint.constants import DS_VERSION, PARAM
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from engine.parallel.universal import publish_universal

ENGINE_STATE = "engine_state.pt"  # the accelerate backend's schedule and client state, beside its DCP files


def universal_from_torch(tag_dir: Path, train_batch_size: int) -> Path:
    """The universal form of accelerate checkpoint `tag_dir` (`universal.publish_universal`).
    `train_batch_size` counts DeepSpeed's samples seen (the monitors' x axis), which the accelerate
    backend does not record."""
    return publish_universal(tag_dir, lambda staging: _write_universal(tag_dir, staging, train_batch_size))


def _write_universal(tag_dir: Path, staging: Path, train_batch_size: int) -> None:
    (staging / "zero").mkdir(parents=True)
    whole = staging / "whole.pt"
    dcp_to_torch_save(tag_dir, whole)
    state = torch.load(whole, map_location="cpu", weights_only=False)
    whole.unlink()
    model, optimizer = state["model"], state["optimizer"]
    for name, adam in optimizer["state"].items():
        folder = staging / "zero" / name
        folder.mkdir()
        torch.save({PARAM: model[name].float()}, folder / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({PARAM: adam[key].float()}, folder / f"{key}.pt")
        torch.save(adam["step"], folder / "step.pt")
    groups = [{**group, "params": list(range(len(group["params"])))} for group in optimizer["param_groups"]]
    torch.save({DS_VERSION: deepspeed.__version__, "param_groups": groups}, staging / "zero" / "optimizer_state.pt")
    torch.save(_engine_state(tag_dir, model, train_batch_size), staging / "mp_rank_00_model_states.pt")


def _engine_state(tag_dir: Path, model: dict[str, torch.Tensor], train_batch_size: int) -> dict[str, Any]:
    """What DeepSpeed's `_load_checkpoint` reads from the model states of a universal checkpoint;
    everything it does not own comes back to the engine as the client state."""
    saved = torch.load(tag_dir / ENGINE_STATE, map_location="cpu", weights_only=False)
    client = saved["client_state"]
    return {
        **client,
        "module": model,
        "lr_scheduler": saved["scheduler"],
        "global_steps": client["step"],
        "global_samples": client["step"] * train_batch_size,
        "skipped_steps": 0,
        "dp_world_size": client["world_size"],
        "mp_world_size": 1,
        DS_VERSION: deepspeed.__version__,
    }
