"""The benchmark harness run for real, at tiny sizes (speed is never asserted in tests): a paired
trial in a fresh process trains the engine and its PyTorch baseline alike, and the data benchmark
runs end to end, its launches included. The harness without running anything is
tests/unit/test_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench import data, throughput
from bench.settings import Settings
from bench.trials import paired_trial, run_overrides
from tests.support.benchmarks import embedded_source  # noqa: F401 (a fixture: pytest finds it by name)


def test_paired_trial_trains_the_engine_and_the_baseline_alike(tmp_path: Path) -> None:
    """One real paired process: the PyTorch loop, stepped between the engine's windows, starts
    from the same weights and reads the same batches, so its losses are the engine's. The trial
    records the machine it ran on, with the thread count both sides used."""
    overrides = [
        "data.type=synthetic",
        "scheduler.params.warmup_num_steps=2",
        *run_overrides(steps=12, log_interval=4, eval_batches=2, threads=1),
    ]
    pair = paired_trial("torch", throughput.CONFIG, overrides, tmp_path / "paired")
    engine, baseline = dict(pair.engine.losses), dict(pair.baseline.losses)
    assert set(engine) == set(baseline) == {4, 8, 12}
    assert [baseline[step] for step in (4, 8, 12)] == pytest.approx([engine[step] for step in (4, 8, 12)], rel=1e-5)
    assert pair.baseline.eval_loss == pytest.approx(pair.engine.eval_loss, rel=1e-5)
    assert pair.engine.seconds_per_step > 0 and pair.baseline.seconds_per_step > 0 and pair.ratio > 0
    assert pair.machine["threads"] == 1 and pair.machine["torch"] == torch.__version__ and pair.machine["cpu"]


@pytest.mark.launch
@pytest.mark.usefixtures("embedded_source")
def test_data_benchmark_runs_end_to_end_at_tiny_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole data benchmark on corpora of 200 and 400 KB, 1 rank, one round, without the warm-up
    launch (the suite's earlier launches built DeepSpeed's op): every part runs and the result has
    its rows, goals and panels. No figure is asserted beyond being measured."""
    monkeypatch.setattr(data, "RUN_DIR", tmp_path / "runs")
    monkeypatch.setattr(data, "PREPARE_REPEATS", 1)  # each preparation once: the suite times nothing
    settings = Settings(rounds=1, steps=2, log_interval=1, quality_steps=1, quality_rounds=1, threads=1)
    result = data.measure(settings, (0.2, 0.4), ranks=(1,), warm_up=False)
    assert result.failures == {}
    versus = "1 rank, 0.4 MB vs 0.2 MB"
    prepared = [
        (f"{name}, {size} MB: prepare {quantity} vs {baseline}", goal)
        for size in ("0.4", "0.2")
        for name, baseline, quantities in (
            ("byte", "bare read", [("MB/s", "engine >= 100"), ("tokens/s", "")]),
            ("char", "bare read", [("MB/s", "engine >= 100"), ("tokens/s", "")]),
            ("BPE", "encode_batch_fast alone", [("seconds", "ratio <= 1.2"), ("MB/s", ""), ("tokens/s", "")]),
        )
        for quantity, goal in quantities
    ]
    assert [(row.quantity, row.goal) for row in result.rows] == [
        (f"{versus}: rank 0 peak RSS, MiB", "ratio <= 1.1"),
        (f"{versus}: cached launch to step 1, s", "ratio <= 1.2"),
        (f"{versus}: first launch to step 1, s", ""),
        (f"1 rank, 0.4 MB: steps trained of {data.STEPS}", "ratio >= 1"),
        *prepared,
    ]
    assert result.rows[3].engine == data.STEPS and result.rows[3].met
    assert all(row.baseline > 0 and row.engine > 0 for row in result.rows)
    assert result.rows[0].baseline > 50  # MiB: a process that imported torch, not a reading of the wrong process
    assert [panel.title for panel in result.panels] == ["data: peak RSS per rank", "data: launch to step 1"]
    assert result.panels[0].series == {"1 rank: rank 0": ([0.2, 0.4], [result.rows[0].baseline, result.rows[0].engine])}
    assert (tmp_path / "runs" / "1-rank-0.4-MB-cached-launch-round-1" / "metrics.jsonl").is_file()
