"""Reading back what DeepSpeed's monitor wrote for a run: its CSV files and TensorBoard events."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.support.launch import read_run

# Both monitors write to <output_path>/<job_name>; the engine's "auto" path and DeepSpeed's job name.
MONITORS = {"tensorboard.enabled": True, "csv_monitor.enabled": True}
JOB_NAME = "DeepSpeedJobName"


def monitor_dir(output_dir: Path) -> Path:
    return output_dir / "monitor" / JOB_NAME


def csv_values(directory: Path, tag: str) -> dict[int, float]:
    """{step: value} of DeepSpeed's csv monitor file for `tag` (named as csvMonitor names it)."""
    with open(directory / (tag.replace("/", "_").replace(" ", "_") + ".csv")) as handle:
        return {int(step): float(value) for step, value in csv.reader(handle) if step != "step"}


def csv_rows(directory: Path) -> dict[str, list[list[str]]]:
    """Every CSV file of the monitor directory, by name, as its rows (header included)."""
    rows = {}
    for path in sorted(directory.glob("*.csv")):
        with open(path, newline="") as handle:
            rows[path.stem] = list(csv.reader(handle))
    return rows


def tensorboard_events(directory: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every scalar event for `tag` that TensorBoard's reader keeps, in order."""
    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def assert_monitors_rewound(resumed: Path, straight: Path, exact: tuple[str, ...]) -> None:
    """A run resumed in the directory of a crashed one holds, in every CSV file and in TensorBoard,
    each step once, under one header, as the uninterrupted run does; and the same values for the
    metrics in `exact` (the others are times and memory, which differ between runs)."""
    resumed_rows, straight_rows = csv_rows(monitor_dir(resumed)), csv_rows(monitor_dir(straight))
    assert resumed_rows.keys() == straight_rows.keys()
    for name, rows in straight_rows.items():
        assert [row[0] for row in resumed_rows[name]] == [row[0] for row in rows], name
    for key in exact:
        tag = f"Train/Samples/{key}"
        assert resumed_rows[tag.replace("/", "_")] == straight_rows[tag.replace("/", "_")], key
        assert tensorboard_events(monitor_dir(resumed), tag) == tensorboard_events(monitor_dir(straight), tag), key


def tensorboard_values(directory: Path, tag: str) -> dict[int, float]:
    """{step: value} of every scalar event for `tag` in the event files of `directory`."""
    return dict(tensorboard_events(directory, tag))


def assert_monitor_holds(output_dir: Path, key: str) -> dict[int, float]:
    """Every logged value of metric `key` is in the run's CSV and TensorBoard files, at x = step x
    global batch; returns the CSV values."""
    records = read_run(output_dir).records
    batch = json.loads((output_dir / "resolved_config.json").read_text())["train_batch_size"]
    expected = {record["step"] * batch: record[key] for record in records if key in record}
    assert expected
    directory = monitor_dir(output_dir)
    written = csv_values(directory, f"Train/Samples/{key}")
    assert written == expected
    # TensorBoard stores scalars as float32.
    assert tensorboard_values(directory, f"Train/Samples/{key}") == pytest.approx(expected, rel=1e-6)
    return written
