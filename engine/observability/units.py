"""Byte counts as the engine prints them, in one place: the planner's tables and the pre-flight's
messages (engine/launch/nvme.py) must say the same size the same way."""

from __future__ import annotations


def format_bytes(count: float) -> str:
    """Two decimals of the largest binary unit that fits: "1.07 TiB", "64.00 KiB", "512 B"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{int(count)} B"
