"""The run as `describe_run` settled it, before any process group: one frozen description that the trainer,
the loop's settings, the backends and the checkpoints read, so that nothing after the pre-flight
loads the config again, parses a duration or a signal name, or settles the vocabulary a second time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from data.bundle import DataBundle
from engine.checkpoints.reshape import CheckpointManifest
from engine.checkpoints.store import CheckpointRef
from engine.config import EngineConfig
from engine.config.batch import BatchTriple
from engine.config.stop_settings import StopSettings
from engine.failures.faults import Fault
from engine.launch.hardware import Hardware
from engine.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class RunDescription:
    """Everything a run is, resolved: the config (vocabulary settled, precision routed: what
    resolved_config.json records) and the typed answers read from it once."""

    config: EngineConfig
    data: DataBundle  # the datasets, built once; `data.kind` is their registry entry (data/kinds/)
    hardware: Hardware
    batch: BatchTriple
    layout: ParallelLayout
    stops: StopSettings
    vocab_size: int | None  # the model's embedding rows; None for a family without a vocabulary
    # What `deepspeed.initialize` (or accelerate's plugin) gets: optimizer, scheduler, ZeRO, precision,
    # and `checkpoint.load_universal` where this run resumes through a universal checkpoint.
    deepspeed_config: dict[str, Any]
    resume: CheckpointRef | None
    saved_manifest: CheckpointManifest | None  # the manifest of the checkpoint resumed from
    manifest: CheckpointManifest  # this run's, recorded with each of its checkpoints
    reshape: bool  # saved on another layout: resume through a universal checkpoint
    fault: Fault | None
    parameters: int = 0  # the model's, counted where trainer.max_wall_time needs a save's duration
