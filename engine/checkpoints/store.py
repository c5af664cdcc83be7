"""Where checkpoints live, how one is published, and which one a resume picks.

Layout: <output_dir>/checkpoints/step00000010/ (one tag per saved step, DeepSpeed's or the
accelerate backend's files inside, plus every rank's RNG state and persistent buffers, the saving
layout and, once a resume on another layout has converted it, its universal form) and a `latest`
file naming the newest complete tag. A tag name that sorts by step keeps `ls` readable.

Publishing is what makes a checkpoint trustworthy. Every rank writes into `<tag>.partial`; only
after all ranks have finished does rank 0 rename it to `<tag>` and then replace `latest`, each an
atomic rename on one filesystem. A crash at any moment of a save leaves `latest` naming the
previous complete checkpoint, and a later save clears the stale `.partial`. DeepSpeed's own
`latest` is not used: rank 0 writes it as soon as its own files are done, before the other
ranks' partitions are.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.checkpoints.reshape import MANIFEST_FILE, CheckpointManifest, write_manifest
from engine.parallel.process_group import barrier, env_rank

LATEST = "latest"
PARTIAL = ".partial"
ABANDONED = ".abandoned"
_TAG = re.compile(r"^step(\d{8})$")


class CheckpointRef(NamedTuple):
    """A checkpoint: the folder that holds a run's checkpoints, and its tag there."""

    root: Path
    tag: str

    @property
    def path(self) -> Path:
        return self.root / self.tag

    @property
    def step(self) -> int | None:
        return tag_step(self.tag)


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def tag_step(tag: str) -> int | None:
    """The step a published tag names; None for a folder named otherwise."""
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def latest_checkpoint(root: Path) -> Path | None:
    """The folder of the newest published checkpoint under `root`, or None."""
    tag = latest_tag(root)
    return None if tag is None else root / tag


def latest_tag(root: Path) -> str | None:
    """The tag `latest` names or, where `latest` is missing or names a folder that is gone, the newest
    published one (every `stepNNNNNNNN` folder is complete: saves are published by rename); None when
    nothing was published."""
    marker = root / LATEST
    if marker.is_file():
        tag = marker.read_text().strip()
        if (root / tag).is_dir():
            return tag
    published = published_tags(root) if root.is_dir() else []
    return published[-1] if published else None


def resume_target(resume: bool | str, output_dir: Path) -> CheckpointRef | None:
    """The checkpoint `trainer.resume` asks for; None for a fresh start.

    Raises FileNotFoundError naming the directory when a resume is asked for but nothing is
    there, and FileExistsError when a fresh start would share `output_dir` with an earlier run's
    checkpoints (its `latest`, its pruning and its metrics would mix with this run's), so the run
    stops before any process group starts.
    """
    if resume is False:
        root = checkpoint_root(output_dir)
        earlier = latest_tag(root)
        if earlier is not None:
            raise FileExistsError(
                f"trainer.output_dir {output_dir} holds an earlier run's checkpoints (latest: {earlier}); set "
                f"trainer.resume=true to continue it, or start afresh in another output_dir or after deleting {root}"
            )
        return None
    if resume is True:
        root = checkpoint_root(output_dir)
        tag = latest_tag(root)
        if tag is None:
            raise FileNotFoundError(f"trainer.resume is true but {root} holds no checkpoint to resume from")
        return CheckpointRef(root, tag)
    path = Path(resume)
    if path.name.endswith(PARTIAL):
        raise FileNotFoundError(f"trainer.resume: {path} is an unfinished save (a crash interrupted it)")
    if latest_tag(checkpoint_root(path)) is not None:  # a run's output_dir: its latest checkpoint
        path = checkpoint_root(path)
    if _holds_checkpoint(path):
        return CheckpointRef(path.parent, path.name)
    tag = latest_tag(path) if path.is_dir() else None  # a checkpoints directory: its latest
    if tag is None:
        raise FileNotFoundError(
            f"trainer.resume: {path} is not a checkpoint; give a checkpoint directory (checkpoints/stepNNNNNNNN), "
            "the checkpoints directory or the run's output_dir"
        )
    return CheckpointRef(path, tag)


def _holds_checkpoint(path: Path) -> bool:
    """DeepSpeed's model states (`*model_states.pt`, per stage under pipelines), the accelerate
    backend's engine state, or the manifest every save of this engine records."""
    from engine.checkpoints.from_torch import ENGINE_STATE  # torch.distributed.checkpoint: not for `validate`

    markers = (MANIFEST_FILE, ENGINE_STATE)
    return path.is_dir() and (any((path / name).is_file() for name in markers) or any(path.glob("*model_states.pt")))


def stage_checkpoint(
    write: Callable[[Path, str], None],
    root: Path,
    step: int,
    manifest: CheckpointManifest,
    buffers: Mapping[str, torch.Tensor],
    data_position: Mapping[str, Any] | None = None,
) -> None:
    """Collective: every rank writes its part of the checkpoint of `step` into `<tag>.partial` with
    `write(root, staging_tag)`, after rank 0 has cleared what crashed saves left there.

    `manifest` (engine.checkpoints.reshape.CheckpointManifest) is kept with the checkpoint, so a resume on
    another layout knows what it is converting from. `data_position` is this rank's place in a streamed
    corpus, if it reads one. `write` may return before its files are whole (`trainer.async_save`):
    the checkpoint is published only by `publish_checkpoint`, once they are on every rank."""
    staging = step_tag(step) + PARTIAL
    if env_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*" + PARTIAL):  # left by saves a crash interrupted
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    barrier()
    write(root, staging)
    save_rng_state(root / staging, env_rank())
    save_rank_buffers(root / staging, env_rank(), buffers)
    if data_position is not None:
        save_data_position(root / staging, env_rank(), data_position)
    if env_rank() == 0:
        write_manifest(root / staging, manifest)


def publish_checkpoint(
    root: Path, step: int, keep_last: int, before_publish: Callable[[int], None] = lambda step: None
) -> str:
    """Collective, once this rank's files of the checkpoint of `step` are whole: when every rank's
    are, rank 0 publishes it and prunes the oldest. `before_publish` runs on every rank first (the
    fault-injection point for a crash mid-save). Returns the published tag."""
    tag = step_tag(step)
    before_publish(step)
    barrier()
    if env_rank() == 0:
        publish(root, tag + PARTIAL, tag)
        prune(root, keep_last)
    barrier()
    return tag


def publish(root: Path, staging: str, tag: str) -> None:
    """Make `staging` the checkpoint `tag` and name it in `latest`, by atomic renames only, so that at
    any instant `latest` names a complete checkpoint."""
    replaced = root / (tag + ".replaced" + PARTIAL)  # swept with the stale saves if a crash strands it
    if (root / tag).exists():
        # The same step saved again, after a resume from an earlier one. The old copy is renamed
        # aside, not deleted, until the new one has its name; should `latest` name the old copy,
        # it names the newest other checkpoint while the two trade places.
        if latest_tag(root) == tag and (others := [name for name in published_tags(root) if name != tag]):
            _name_latest(root, others[-1])
        os.replace(root / tag, replaced)
    os.replace(root / staging, root / tag)
    _name_latest(root, tag)
    if replaced.exists():
        shutil.rmtree(replaced)
    _set_aside_later_steps(root, tag)


def _set_aside_later_steps(root: Path, tag: str) -> None:
    """Checkpoints of later steps than `tag`, just published, were saved by the run this one resumed
    from an earlier checkpoint: another history. They are kept, renamed `<tag>.abandoned`, out of the
    way of pruning (which would keep them as the newest and delete this run's) and of the newest-step
    fallback when `latest` is lost (which would resume them)."""
    step = tag_step(tag)
    for later in [name for name in published_tags(root) if tag_step(name) > step]:
        target = root / (later + ABANDONED)
        copies = 1
        while target.exists():
            copies += 1
            target = root / f"{later}{ABANDONED}{copies}"
        os.replace(root / later, target)


def published_tags(root: Path) -> list[str]:
    """The published tags under `root`, oldest step first."""
    return sorted(path.name for path in root.iterdir() if path.is_dir() and _TAG.match(path.name))


def _name_latest(root: Path, tag: str) -> None:
    pending = root / (LATEST + PARTIAL)
    with open(pending, "w") as handle:
        handle.write(tag)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(pending, root / LATEST)


def prune(root: Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` published tags (0: keep all); returns what went."""
    if keep_last <= 0:
        return []
    tags = published_tags(root)
    current = latest_tag(root)
    doomed = [tag for tag in tags[:-keep_last] if tag != current]
    for tag in doomed:
        shutil.rmtree(root / tag)
    return doomed


def _rng_path(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank{rank}.pt"


def save_rng_state(directory: Path, rank: int) -> None:
    """Each rank's generators (dropout, augmentation): without them a resumed run draws different
    masks from the uninterrupted one and stops being bit-identical."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    path = _rng_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def load_rng_state(directory: Path, rank: int) -> bool:
    """Restore this rank's generators if the checkpoint has them for this rank; False otherwise
    (a checkpoint from another layout, or from before RNG states were saved)."""
    path = _rng_path(directory, rank)
    if not path.is_file():
        return False
    state = torch.load(path, map_location="cpu", weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    return True


def _buffers_path(directory: Path, rank: int) -> Path:
    return directory / "buffers" / f"rank{rank}.pt"


def save_rank_buffers(directory: Path, rank: int, buffers: Mapping[str, torch.Tensor]) -> None:
    """Each rank's persistent buffers (a ResNet's batch-norm statistics, which every rank updates
    from its own samples): DeepSpeed's and torch's checkpoints keep one rank's copy, and a resume
    that gave rank 0's to every rank would evaluate differently from the uninterrupted run."""
    if not buffers:
        return
    path = _buffers_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: tensor.detach().cpu() for name, tensor in buffers.items()}, path)


def load_rank_buffers(directory: Path, rank: int, buffers: Mapping[str, torch.Tensor]) -> bool:
    """Copy this rank's saved buffers into `buffers` when the checkpoint has the same ones for this
    rank; False otherwise (another split names them differently; the backend's load then stands)."""
    path = _buffers_path(directory, rank)
    if not path.is_file():
        return False
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.keys() != buffers.keys():
        return False
    with torch.no_grad():
        for name, tensor in buffers.items():
            tensor.copy_(saved[name])
    return True


def _data_position_path(directory: Path, rank: int) -> Path:
    return directory / "data" / f"rank{rank}.pt"


def save_data_position(directory: Path, rank: int, position: Mapping[str, Any]) -> None:
    """This rank's place in a streamed corpus (data/streaming.py): a stream has no index to recompute
    from the step, so a resume that did not restore it would read from the start again."""
    path = _data_position_path(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dict(position), path)


def load_data_position(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's saved place in the stream; FileNotFoundError naming the checkpoint where there is none."""
    path = _data_position_path(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(
            f"trainer.resume: checkpoint {directory} holds no stream position for rank {rank}: it was not saved by "
            "a run streaming this data (data.streaming)"
        )
    return torch.load(path, map_location="cpu", weights_only=False)
