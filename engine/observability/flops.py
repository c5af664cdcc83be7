"""Achieved model FLOP/s and MFU from a run's throughput.

The FLOPs to train on one item (token, image) are the family's (`ModelFamily.flops_per_item`,
models/costs.py); the devices' peaks are facts about hardware (engine/launch/hardware.py).
"""

from __future__ import annotations


def achieved_flops_per_device(flops_per_item: float, items_per_s: float, world_size: int) -> float:
    """Model FLOP/s each device delivers, from the whole job's throughput.

    `world_size` counts every device of the job, not the data-parallel degree: tensor and pipeline
    ranks share the work on the same items.
    """
    return flops_per_item * items_per_s / world_size


def mfu(flops_per_item: float, items_per_s: float, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: the fraction of the job's summed device peaks its throughput uses."""
    return achieved_flops_per_device(flops_per_item, items_per_s, world_size) / peak_flops
