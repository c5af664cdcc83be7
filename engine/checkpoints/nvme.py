"""Checkpoints of runs whose optimizer states DeepSpeed swaps to NVMe (ZeRO-Infinity).

DeepSpeed 0.19.8 saves such a run in two places: the optimizer states file of each rank holds the
sub-groups kept in host memory (those under max(1 MiB, aio.block_size), DeepSpeed's smallest swap)
and, for every swapped sub-group, an empty tensor; the swapped fp32 masters and Adam moments are
copies of the swap files, in `<tag>/offloaded_tensors/rankNN/`, named by the sub-group's first and
last parameter id (`6_10.tensor.swp`, `exp_avg-6_10.tensor.swp`). Its `zero_to_fp32` reads the
optimizer files alone and fails on the empty tensors; here the swapped masters are read back from
their files first. Its universal conversion, which a resume on another layout goes through, reads
them the same way, and a resume that swaps where the checkpoint did not (or the reverse) would
start from empty or missing states: both are refused before launch.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

OFFLOADED = "offloaded_tensors"
_MASTER_FILE = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")


def swapped_optimizer(tag_dir: Path) -> bool:
    """Whether the checkpoint `tag_dir` was saved with its optimizer states on NVMe."""
    return (tag_dir / OFFLOADED).is_dir()


def fp32_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of the ZeRO checkpoint `tag_dir`, as DeepSpeed's `zero_to_fp32` joins them,
    with the masters of NVMe-swapped sub-groups read from the checkpoint's copies of the swap files."""
    from deepspeed.utils import zero_to_fp32

    folder = str(tag_dir)
    if not swapped_optimizer(tag_dir):
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(folder))
    stage, world_size, flat_groups, _ = zero_to_fp32.parse_optim_states(zero_to_fp32.get_optim_files(folder), folder)
    if stage != 3:
        raise ValueError(f"{tag_dir}: swapped optimizer states under ZeRO-{stage}; DeepSpeed swaps under ZeRO-3 only")
    # ZeRO-3 saves one shape record per optimizer sub-group, in the order of the flat groups.
    sizes = [
        sum(math.ceil(shape.numel() / world_size) for shape in shapes.values())
        for shapes in model_states[0].param_shapes
    ]
    groups = [
        _with_swapped_masters(rank_groups, sizes, tag_dir / OFFLOADED / f"rank{rank:02d}")
        for rank, rank_groups in enumerate(flat_groups)
    ]
    lazy = zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(world_size, groups, model_states, False)
    return zero_to_fp32.to_torch_tensor(lazy)


def _with_swapped_masters(groups: list[torch.Tensor], sizes: list[int], folder: Path) -> list[torch.Tensor]:
    """One rank's flat fp32 sub-groups, each empty one replaced by its swap file's first `size`
    elements (a file is padded to DeepSpeed's I/O alignment). Swapped sub-groups are named by their
    parameter ids, which rise with the sub-groups' order."""
    files = sorted(
        (path for path in folder.glob("*.tensor.swp") if _MASTER_FILE.match(path.name)),
        key=lambda path: int(_MASTER_FILE.match(path.name)[1]),
    )
    swapped = [index for index, group in enumerate(groups) if group.numel() == 0 and sizes[index]]
    if len(files) != len(swapped) or len(groups) != len(sizes):
        raise ValueError(
            f"{folder}: {len(files)} swapped masters for {len(swapped)} empty sub-groups of {len(groups)}; "
            "the checkpoint is incomplete"
        )
    joined = list(groups)
    for index, path in zip(swapped, files, strict=True):
        joined[index] = torch.from_file(str(path), size=sizes[index], dtype=torch.float32)
    return joined


def resume_problem(tag_dir: Path, swaps_optimizer: bool, reshape: bool) -> str | None:
    """Why the checkpoint `tag_dir` cannot be resumed by a run that does (`swaps_optimizer`) or does
    not swap its optimizer states to NVMe, on the same layout or another (`reshape`); None if it can."""
    saved = swapped_optimizer(tag_dir)
    if saved and reshape:
        return (
            f"checkpoint {tag_dir.name} keeps its optimizer states in NVMe swap files, which DeepSpeed's universal "
            "conversion (a resume on another layout) cannot read; resume it on the layout that saved it"
        )
    if saved != swaps_optimizer:
        where = "on NVMe" if saved else "in its optimizer files"
        asked = "swaps them to NVMe" if swaps_optimizer else "does not swap them"
        return (
            f"checkpoint {tag_dir.name} keeps its optimizer states {where} and this run {asked}; DeepSpeed loads them "
            "only the way they were saved: set zero_optimization.offload_optimizer.device as the saving run had it"
        )
    return None
