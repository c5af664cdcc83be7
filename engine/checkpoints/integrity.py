"""Whether the files of a checkpoint about to be resumed are whole, checked before any process group
exists. Published checkpoints are complete when written (engine.checkpoints.store); what this
catches is damage after the fact: a file truncated by a full disk or a partial copy between
machines, a partition deleted by hand, a stray file. Without it each shows up as a torch or
DeepSpeed traceback on one rank after every rank has started, naming neither the checkpoint nor
the older ones still good.
"""

from __future__ import annotations

import re
import zipfile
from collections import defaultdict
from pathlib import Path

from engine.checkpoints.reshape import CheckpointManifest

# DeepSpeed's per-rank optimizer partitions: zero_pp_rank_<data-parallel rank>_mp_rank_<model-parallel rank>.
_PARTITION = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def check_intact(tag_dir: Path, manifest: CheckpointManifest | None, others: list[str]) -> None:
    """Raise ValueError naming `trainer.resume` when a file of `tag_dir` is not a complete torch
    archive, or when a data-parallel rank's optimizer partition is missing. `manifest` is the saving
    run's record (engine.checkpoints.reshape); `others`, the checkpoint's published neighbours, are
    offered instead. Reads only the end of each file (a zip archive's directory), not the tensors."""
    damaged = [path for path in sorted(tag_dir.rglob("*.pt")) if not zipfile.is_zipfile(path)]
    problems = [f"{path.relative_to(tag_dir)} is not a complete torch.save archive" for path in damaged[:3]]
    if len(damaged) > 3:
        problems.append(f"and {len(damaged) - 3} more such files")
    if manifest is not None:
        problems += _missing_partitions(tag_dir, manifest.zero_ranks)
    if problems:
        instead = f"; resume from an earlier one ({', '.join(others)}) or" if others else ";"
        raise ValueError(
            f"trainer.resume: checkpoint {tag_dir} is damaged: {'; '.join(problems)}{instead} start afresh"
        )


def _missing_partitions(tag_dir: Path, data_parallel: int) -> list[str]:
    """Each model-parallel rank's partitions must cover every data-parallel rank that saved them."""
    ranks: dict[int, set[int]] = defaultdict(set)
    for path in tag_dir.iterdir():
        match = _PARTITION.match(path.name)
        if match:
            ranks[int(match.group(2))].add(int(match.group(1)))
    return [
        f"the optimizer partition of data-parallel rank {rank} (model-parallel rank {model}) is missing"
        for model, present in sorted(ranks.items())
        for rank in sorted(set(range(data_parallel)) - present)
    ]
