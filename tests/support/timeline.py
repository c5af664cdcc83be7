"""Checks shared by the pipeline timeline's tests (tests/unit/test_timeline.py and
tests/launched/test_timeline_launched.py)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def assert_chart(path: Path) -> None:
    with Image.open(path) as image:
        image.load()
        assert image.width > 100 and image.height > 100
