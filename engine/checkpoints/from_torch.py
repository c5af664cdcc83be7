"""Checkpoints of torch optimizer state in DeepSpeed's universal form, for the DeepSpeed backend to
resume on any layout: an accelerate backend's (torch distributed checkpoints of whole tensors or
FSDP2 row pieces) and DeepSpeed's own fp32 ZeRO-0 one (a bare torch optimizer, keyed by position).

Both are written as `ds_to_universal` writes: per parameter the fp32 weight and Adam's moments and
step, plus the optimizer's common state and the engine state DeepSpeed's universal loader reads, so
`checkpoint.load_universal` cuts them like any conversion. Neither conversion holds the model and
both Adam moments in memory at once. The story and its measurements: docs/checkpoints.md,
"Resuming on another layout", and docs/design/checkpoints.md, "Reshaping goes through DeepSpeed's universal
checkpoint, with our names and cuts added".
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.checkpoint.constants import DS_VERSION, PARAM
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from engine.checkpoints.universal import publish_universal, saved_optimizer_order

ENGINE_STATE = "engine_state.pt"  # the accelerate backend's schedule and client state, beside its DCP files


def universal_from_torch(tag_dir: Path, train_batch_size: int) -> Path:
    """The universal form of accelerate checkpoint `tag_dir` (`universal.publish_universal`).
    `train_batch_size` counts DeepSpeed's samples seen (the monitors' x axis), which the accelerate
    backend does not record."""
    return publish_universal(tag_dir, lambda staging: _from_dcp(tag_dir, staging, train_batch_size))


def universal_from_zero0(tag_dir: Path) -> Path:
    """The universal form of a DeepSpeed fp32 ZeRO-0 checkpoint `tag_dir`. Its model states hold the
    whole weights and torch's own optimizer state, keyed by position; the save recorded which
    parameter each position is (`OPTIMIZER_ORDER`). `ds_to_universal` reads ZeRO partitions only."""
    return publish_universal(tag_dir, lambda staging: _from_zero0(tag_dir, staging))


def _from_dcp(tag_dir: Path, staging: Path, train_batch_size: int) -> None:
    reader = FileSystemReader(tag_dir)
    paths = reader.read_metadata().planner_data.values()
    # Flattened keys of an optimizer state are ("optimizer", "state", parameter name, "exp_avg").
    names = dict.fromkeys(path[2] for path in paths if path[:2] == ("optimizer", "state"))
    saved = _read_dcp(reader, {"model", "optimizer.param_groups"})
    adam = ((name, _read_dcp(reader, {f"optimizer.state.{name}"})["optimizer"]["state"][name]) for name in names)
    staging.mkdir()
    engine_state = _engine_state(tag_dir, saved["model"], train_batch_size)
    _write(staging, saved["model"], saved["optimizer"]["param_groups"], adam, engine_state)


def _read_dcp(reader: FileSystemReader, keys: set[str]) -> dict[str, Any]:
    """The entries of a DCP checkpoint under `keys` (dotted prefixes of the saved nesting), whole, in
    this process alone. The loader and planner are the ones torch's `dcp_to_torch_save` runs (both
    private to torch); its planner takes `keys` to read only those entries."""
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return state


def _from_zero0(tag_dir: Path, staging: Path) -> None:
    engine_state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False, mmap=True)
    order = saved_optimizer_order(tag_dir)
    optimizer = engine_state.pop("optimizer")
    by_name = {
        "state": {order[index]: state for index, state in optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [order[i] for i in group["params"]]} for group in optimizer["param_groups"]
        ],
    }
    staging.mkdir()
    _write(staging, engine_state["module"], by_name["param_groups"], by_name["state"].items(), engine_state)


def _write(
    staging: Path,
    model: dict[str, torch.Tensor],
    groups: list[dict[str, Any]],
    adam_states: Iterable[tuple[str, dict[str, Any]]],
    engine_state: dict[str, Any],
) -> None:
    """`model` and torch's full optimizer state (its param `groups` and each parameter's Adam state,
    by name) as a universal checkpoint. Each Adam state is taken from `adam_states` as its folder is
    written, so a caller can read them one at a time."""
    (staging / "zero").mkdir()
    for name, adam in adam_states:
        folder = staging / "zero" / name
        folder.mkdir()
        torch.save({PARAM: model[name].float()}, folder / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            torch.save({PARAM: adam[key].float()}, folder / f"{key}.pt")
        torch.save(adam["step"], folder / "step.pt")
    groups = [{**group, "params": list(range(len(group["params"])))} for group in groups]
    torch.save({DS_VERSION: deepspeed.__version__, "param_groups": groups}, staging / "zero" / "optimizer_state.pt")
    torch.save(engine_state, staging / "mp_rank_00_model_states.pt")


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
