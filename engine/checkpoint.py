"""Where checkpoints live and which one a resume picks.

Layout: <output_dir>/checkpoints/step00000010/ (one DeepSpeed tag per saved step) and DeepSpeed's
`latest` file naming the newest complete tag. A tag name that sorts by step keeps `ls` readable.
"""

from __future__ import annotations

from pathlib import Path

LATEST = "latest"


def checkpoint_root(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def step_tag(step: int) -> str:
    return f"step{step:08d}"


def latest_tag(root: Path) -> str | None:
    """The tag DeepSpeed recorded as newest under `root`, or None when nothing was saved."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    tag = marker.read_text().strip()
    return tag if (root / tag).is_dir() else None


def resume_target(resume: bool | str, output_dir: Path) -> tuple[Path, str] | None:
    """(checkpoint root, tag) that `trainer.resume` asks for; None for a fresh start.

    Raises FileNotFoundError naming the directory when a resume is asked for but nothing is
    there, so the run stops before any process group starts.
    """
    if resume is False:
        return None
    if resume is True:
        root = checkpoint_root(output_dir)
        tag = latest_tag(root)
        if tag is None:
            raise FileNotFoundError(f"trainer.resume is true but {root} holds no checkpoint to resume from")
        return root, tag
    path = Path(resume)
    if (path / LATEST).is_file():
        tag = latest_tag(path)
        if tag is None:
            raise FileNotFoundError(f"trainer.resume: {path}/latest names a checkpoint that is not there")
        return path, tag
    return path.parent, path.name
