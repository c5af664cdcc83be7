"""`describe_run` settles the run once: one frozen description holding what the trainer, the backends
and the checkpoints read (the batch, the layout, the vocabulary, the stop settings, the DeepSpeed
settings, the manifest), from one loading of the config; the planner settles nothing again."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest

import engine.describe
from engine.checkpoints.reshape import CheckpointManifest
from engine.checkpoints.store import CheckpointRef
from engine.config import load_config
from engine.config.batch import BatchTriple
from engine.describe import describe_run, keep_configured_stage
from engine.launch.hardware import detect_hardware
from engine.plan import plan_run
from engine.preflight import check_data
from tests.support.launch import ROOT

CONFIG = str(ROOT / "configs" / "tiny_gpt.json")


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")


def test_prepare_loads_the_config_once_and_describes_the_run(
    one_rank: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    loads = []

    def counted(*args, **kwargs):
        loads.append(args)
        return load_config(*args, **kwargs)

    monkeypatch.setattr(engine.describe, "load_config", counted)
    overrides = [
        f"trainer.output_dir={tmp_path}",
        "trainer.save_on_signal=true",
        'trainer.signals=["SIGUSR1", "TERM"]',
        "trainer.max_wall_time=1h30m",
        "train_micro_batch_size_per_gpu=2",
        "gradient_accumulation_steps=3",
        "zero_optimization.stage=2",
    ]
    description = describe_run(CONFIG, overrides)
    assert len(loads) == 1
    config = description.config
    assert description.batch == BatchTriple(6, 2, 3) == config.batch
    assert (description.layout.data, description.layout.pipeline, description.layout.tensor) == (1, 1, 1)
    assert description.stops.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert description.stops.wall_time_s == 5400
    assert description.vocab_size == config.model.vocab_size == description.manifest.vocab_size
    assert description.vocab_size == description.data.vocab_size  # "auto", settled from the tokenizer
    assert description.deepspeed_config == config.deepspeed_config()
    # One rank: the fast path runs the configured ZeRO-2 as stage 0, and says so once.
    assert config.zero_stage == 0 and description.manifest.zero_stage == 0 and config.rerouted
    with pytest.raises(dataclasses.FrozenInstanceError):
        description.batch = BatchTriple(1, 1, 1)


def test_the_configured_stage_comes_from_the_same_loading(one_rank: None, tmp_path: Path):
    """A one-rank resume of a ZeRO-2 checkpoint keeps stage 2: the config as written, resolved beside
    the rerouted one in the same load, equals a second load without the fast path."""
    hardware = detect_hardware()
    config = load_config(CONFIG, ["zero_optimization.stage=2"], world_size=1, hardware=hardware)
    written = load_config(
        CONFIG, ["zero_optimization.stage=2", "trainer.single_rank_fast_path=false"], world_size=1, hardware=hardware
    )
    assert config.zero_stage == 0 and config.as_configured.document == written.document
    saved = CheckpointManifest("deepspeed", 2, 1, 1, 2, 65, 2, None, 8, 100)
    kept = keep_configured_stage(config, CheckpointRef(tmp_path, "step00000003"), saved)
    assert kept.zero_stage == 2 and kept.document == written.document
    assert "saved under ZeRO-2" in kept.rerouted
    # The vocabulary, once settled, is settled in both.
    settled = config.with_vocab_size(65)
    assert settled.as_configured.model.vocab_size == settled.model.vocab_size == 65


def test_the_planner_takes_the_vocabulary_the_data_settled():
    config = load_config(CONFIG, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    with pytest.raises(ValueError, match="engine.preflight.check_data"):
        plan_run(config)
    settled, bundle = check_data(config)
    assert plan_run(settled).config.model.vocab_size == bundle.vocab_size
