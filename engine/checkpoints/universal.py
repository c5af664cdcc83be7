"""DeepSpeed universal checkpoints for this engine's layouts.

DeepSpeed's `ds_to_universal` turns a checkpoint of any data-parallel size and ZeRO stage into one
folder per parameter (full fp32 weight, Adam moments, step), and `checkpoint.load_universal` cuts
those back into whatever partitions the loading run has. Two things it cannot know are supplied
here. How this engine's tensor-parallel layers cut each weight: `universal_info` describes every
parameter in the pattern vocabulary the converter reads from the checkpoint. And the names: a
pipeline stage calls a parameter `3.attn.c_attn.weight` where the whole model says
`transformer.h.1.attn.c_attn.weight`; `loading_view` links the folders, saved under the saving
run's names, under the loading run's, through the unsplit model's names both record.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from deepspeed.checkpoint.constants import (
    CLIP_GRAD,
    DS_VERSION,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAMETER_TO_AVERAGE_PATTERNS,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    SUB_PARAM_SHARD_WIDTHS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
)
from torch import nn

from engine.checkpoints.reshape import NAMES_FOLDER, OPTIMIZER_ORDER
from models.module_state import persistent_buffers
from parallelism.tensor import SHARD_ATTRIBUTE, Shard

UNIVERSAL_FOLDER = "universal"
ZERO3_PREFIX = "zero_pp_rank_0_"


def universal_info(module: nn.Module, tensor_size: int) -> dict[str, Any]:
    """`UNIVERSAL_CHECKPOINT_INFO` for `module` as this rank holds it: how ds_to_universal joins
    each parameter's tensor-parallel slices. Replicated parameters are averaged (their slices are
    equal, so the average is exact where the converter's equality assertion would be brittle), a
    shard along dimension 1 joins along it, a shard of a fused weight (GPT-2's q, k, v) joins
    chunk by chunk, and the rest join along dimension 0, the converter's default."""
    replicated, along_dim_1, fused, widths = [], [], [], {}
    for name, parameter in module.named_parameters():
        pattern = re.escape(name) + "$"
        shard: Shard | None = getattr(parameter, SHARD_ATTRIBUTE, None)
        if shard is None:
            replicated.append(pattern)
        elif shard.chunks > 1:
            chunk = parameter.shape[shard.dim] * tensor_size // shard.chunks
            shape: list[Any] = list(parameter.shape)
            shape[shard.dim] = (chunk,) * shard.chunks
            fused.append({"patterns": [pattern], "shape": tuple(shape), "partition_dim": shard.dim})
            widths[pattern] = [[chunk // tensor_size] * tensor_size for _ in range(shard.chunks)]
        elif shard.dim == 1:
            along_dim_1.append(pattern)
    return {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        PARAMETER_TO_AVERAGE_PATTERNS: replicated,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: along_dim_1,
        PARAMETER_WITH_SUB_PARAMS: fused,
        SUB_PARAM_SHARD_WIDTHS: widths,
        # A tied weight is saved by the first and the last pipeline stage; one copy is converted.
        PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules\."],
    }


def merged_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One `universal_info` for the whole model from every rank's: DeepSpeed reads the info of
    one saved file, and a pipeline stage describes only its own layers."""
    merged: dict[str, Any] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, list):
                merged.setdefault(key, []).extend(item for item in value if item not in merged.get(key, []))
            elif isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
            else:
                merged[key] = value
    return merged


def canonical_names(module: nn.Module, names: Mapping[int, str]) -> dict[str, str]:
    """This rank's parameter and buffer names mapped to the unsplit model's (`names`: by tensor
    identity). Buffers are named too: the universal form leaves them out, and a universal load
    reads them from the saved module states by these names (`saved_buffers`)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {local: names[id(tensor)] for local, tensor in tensors if id(tensor) in names}


def save_names(tag_dir: Path, rank: int, names: Mapping[str, str]) -> None:
    """Every rank records its own names: a pipeline stage knows only its layers'."""
    path = tag_dir / NAMES_FOLDER / f"rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(names, indent=1, sort_keys=True))


def save_optimizer_order(tag_dir: Path, names: Sequence[str]) -> None:
    (tag_dir / NAMES_FOLDER / OPTIMIZER_ORDER).write_text(json.dumps(list(names), indent=1))


def saved_optimizer_order(tag_dir: Path) -> list[str]:
    return json.loads((tag_dir / NAMES_FOLDER / OPTIMIZER_ORDER).read_text())


def saved_names(tag_dir: Path) -> dict[str, str]:
    """The saving run's names of every parameter, all ranks together."""
    merged: dict[str, str] = {}
    for path in sorted((tag_dir / NAMES_FOLDER).glob("rank*.json")):
        merged.update(json.loads(path.read_text()))
    return merged


def saved_buffers(tag_dir: Path, wanted: Sequence[str]) -> dict[str, torch.Tensor]:
    """The persistent buffers `wanted` (a ResNet's batch-norm statistics, by the unsplit model's
    names) as checkpoint `tag_dir` saved them. The universal form holds parameters only, and
    DeepSpeed's universal load skips the module state where the buffers are; so they are read from
    the module states DeepSpeed saved: one file per tensor-parallel rank, or under a pipeline one
    per layer (`layer_NN-...`, the layer named `NN` in the pipeline module). Those files hold the
    weights too, so a model without buffers (GPT) reads none of them, and the files are mapped: only
    the buffers' pages are read."""
    if not wanted:
        return {}
    canonical = saved_names(tag_dir)
    tensors: dict[str, torch.Tensor] = {}
    # The engine state of an accelerate checkpoint's conversion (`from_torch`) holds them too.
    for path in sorted([*tag_dir.glob("*model_states.pt"), *(tag_dir / UNIVERSAL_FOLDER).glob("*model_states.pt")]):
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        if path.name.startswith("layer_"):
            prefix = str(int(path.name.removeprefix("layer_").split("-")[0])) + "."
        else:
            state, prefix = state.get("module") or {}, ""
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[canonical.get(prefix + key, prefix + key)] = value
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise KeyError(f"checkpoint {tag_dir} holds no saved buffer {', '.join(missing)}")
    return {name: tensors[name] for name in wanted}


def restore_buffers(module: nn.Module, names: Mapping[int, str], tag_dir: Path) -> None:
    """Copy the persistent buffers of checkpoint `tag_dir` into this rank's (`names`: the unsplit
    model's name of each tensor, by identity)."""
    buffers = list(persistent_buffers(module).values())
    saved = saved_buffers(tag_dir, [names[id(buffer)] for buffer in buffers])
    with torch.no_grad():
        for buffer in buffers:
            buffer.copy_(saved[names[id(buffer)]])


def publish_universal(tag_dir: Path, write: Callable[[Path], None]) -> Path:
    """The universal form of checkpoint `tag_dir`, converted once and kept inside it: `write` fills
    a staging folder, renamed when complete like every checkpoint, so a crash mid-conversion never
    leaves a half-converted folder that a later resume would trust."""
    target = tag_dir / UNIVERSAL_FOLDER
    if target.is_dir():
        return target
    staging = tag_dir / (UNIVERSAL_FOLDER + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    os.replace(staging, target)
    return target


def convert_to_universal(tag_dir: Path) -> Path:
    """The universal form of DeepSpeed checkpoint `tag_dir`, by DeepSpeed's own converter."""
    return publish_universal(tag_dir, lambda staging: _ds_to_universal(tag_dir, staging))


def _ds_to_universal(tag_dir: Path, staging: Path) -> None:
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    command += ["--input_folder", str(tag_dir), "--output_folder", str(staging), "--inject_missing_state"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if result.returncode != 0:
        output = result.stdout[-2000:] + result.stderr[-3000:]
        raise RuntimeError(f"ds_to_universal could not convert {tag_dir}:\n{output}")
    _zero12_optimizer_state(staging)


def _zero12_optimizer_state(universal_dir: Path) -> None:
    """Make a ZeRO-3 conversion loadable by ZeRO-1/2 too. DeepSpeed converts a ZeRO-3 checkpoint
    into files only ZeRO-3's loader reads: each state a bare flat tensor, the Adam step and the
    DeepSpeed version only in the common state. ZeRO-1/2's loader wants each state as
    `{"param": tensor}` (a flat one is cut the same way), a `step.pt` beside each parameter's states,
    and the version and clipping in the common state. ZeRO-3's loader reads either form, so the
    conversion is rewritten in place, before it is published."""
    zero = universal_dir / "zero"
    common = torch.load(zero / "optimizer_state.pt", weights_only=False)
    if DS_VERSION in common:
        return
    (model_states,) = universal_dir.glob(ZERO3_PREFIX + "mp_rank_*_model_states.pt")
    saved = torch.load(model_states, map_location="cpu", weights_only=False, mmap=True)  # no weights read
    common[DS_VERSION] = saved[DS_VERSION]
    common[CLIP_GRAD] = saved["ds_config"].get("gradient_clipping", 0.0)
    step = common[OPTIMIZER_STATE_DICT]["state"][0]["step"]  # as ZeRO-3's loader reads it: one for all
    for folder in (path for path in zero.iterdir() if path.is_dir()):
        for path in folder.glob("*.pt"):
            torch.save({PARAM: torch.load(path, weights_only=False)}, path)
        torch.save(step.clone(), folder / "step.pt")
    torch.save(common, zero / "optimizer_state.pt")


def loading_view(universal_dir: Path, saved: Mapping[str, str], wanted: Mapping[str, str], view_dir: Path) -> None:
    """A universal checkpoint under the loading run's parameter names, built of links into
    `universal_dir` (which keeps the saving run's names, so any number of layouts can load it).

    `saved` and `wanted` map each run's own names to the unsplit model's names."""
    shutil.rmtree(view_dir, ignore_errors=True)
    (view_dir / "zero").mkdir(parents=True)
    for path in universal_dir.iterdir():
        if path.is_file():
            (view_dir / path.name).symlink_to(path.resolve())
    _link_model_states_for_both_loaders(view_dir)
    for path in (universal_dir / "zero").iterdir():
        if path.is_file():  # the optimizer's common state
            (view_dir / "zero" / path.name).symlink_to(path.resolve())
    _zero3_optimizer_state(universal_dir / "zero", view_dir / "zero")
    saved_as = {canonical: local for local, canonical in saved.items()}
    for local, canonical in wanted.items():
        source = universal_dir / "zero" / saved_as.get(canonical, local)
        if source.is_dir():
            (view_dir / "zero" / local).symlink_to(source.resolve(), target_is_directory=True)


def _link_model_states_for_both_loaders(view_dir: Path) -> None:
    """DeepSpeed reads a universal checkpoint's engine state (step, schedule, client state) from
    `mp_rank_XX_model_states.pt` under ZeRO-1/2 and from `zero_pp_rank_0_mp_rank_XX_...` under
    ZeRO-3, the names the saving stage wrote; the view offers both, so any stage loads any."""
    for path in list(view_dir.iterdir()):
        if path.name.startswith("mp_rank_"):
            twin = view_dir / (ZERO3_PREFIX + path.name)
        elif path.name.startswith(ZERO3_PREFIX + "mp_rank_"):
            twin = view_dir / path.name.removeprefix(ZERO3_PREFIX)
        else:
            continue
        if not twin.exists():
            twin.symlink_to(path.resolve())


def _zero3_optimizer_state(source: Path, target: Path) -> None:
    """ZeRO-3's universal loader reads the Adam step and hyperparameters from the common optimizer
    state in the layout ZeRO-3's converter writes; a ZeRO-1/2 conversion keeps the step per
    parameter instead, so the view's copy of the common state gets it in ZeRO-3's place."""
    common = torch.load(source / "optimizer_state.pt", weights_only=False)
    if "optimizer_state_dict" in common:
        return
    step_file = next(source.glob("*/step.pt"))
    step = torch.load(step_file, weights_only=False)
    common["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": common["param_groups"]}
    (target / "optimizer_state.pt").unlink()
    torch.save(common, target / "optimizer_state.pt")
