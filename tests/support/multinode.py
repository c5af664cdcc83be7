"""Hostfiles for the multi-node tests (tests/unit/test_multinode.py and
tests/launched/test_multinode_launched.py)."""

from __future__ import annotations

from pathlib import Path


def hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hostfile"
    path.write_text(text)
    return path
