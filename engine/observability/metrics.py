"""What rank 0 shows and records: a progress bar and `metrics.jsonl`, one JSON object per
logged step, also handed to any sinks (TensorBoard, CSV, W&B: engine/observability/sinks.py). Values reach
here already reduced over ranks; this module never communicates."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm


class Sink(Protocol):
    """Somewhere else each logged record goes."""

    def write(self, record: dict[str, Any]) -> None: ...

    def rewind(self, step: int) -> None:
        """Forget what an earlier run in the same directory wrote after `step`."""

    def close(self) -> None: ...


class MetricsLogger:
    def __init__(
        self,
        output_dir: Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress_bar: bool,
        sinks: Sequence[Sink] = (),
    ):
        self.enabled = enabled
        self._sinks = list(sinks) if enabled else []
        path = output_dir / "metrics.jsonl"
        if enabled:
            rewind(path, start_step)
        for sink in self._sinks:
            sink.rewind(start_step)
        self._file = open(path, "a") if enabled else None  # noqa: SIM115
        self._bar = (
            tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
            if enabled and progress_bar
            else None
        )
        self._last_step = start_step

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(_strict_json({"time": round(time.time(), 3), **record}), allow_nan=False) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.write(record)
        shown = {key: value for key, value in record.items() if _on_terminal(key, value)}
        if self._bar is not None:
            self._bar.update(record["step"] - self._last_step)
            self._bar.set_postfix({key: _short(value) for key, value in shown.items() if key != "step"})
        else:
            print(" ".join(f"{key}={_short(value)}" for key, value in shown.items()), flush=True)
        self._last_step = record["step"]

    def write(self, text: str) -> None:
        """A line on rank 0's terminal that does not break the progress bar."""
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()


def _on_terminal(key: str, value: Any) -> bool:
    """The headline of a record; the phase times and per-rank memory stay in the file and plots."""
    return not (key == "ranks" or key.startswith("time_") or (key == "skipped_steps" and not value))


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics.jsonl. A last line without its newline is a write that a
    crash, a full disk or a reader racing the run caught half done, not a record."""
    return [json.loads(line) for line in _complete_lines(path.read_text())]


def _complete_lines(text: str) -> list[str]:
    return [line for line in text[: text.rfind("\n") + 1].splitlines(keepends=True) if line.strip()]


def rewind(path: Path, step: int) -> None:
    """Drop records after `step`: a run resumed from an earlier checkpoint in the same directory
    continues the curve from there instead of repeating steps after the ones a crash lost. A half
    written last line goes too, or the next record would be appended to it. The file is replaced
    by rename, so a crash here leaves the old one whole."""
    if not path.is_file():
        return
    text = path.read_text()
    kept = "".join(line for line in _complete_lines(text) if json.loads(line)["step"] <= step)
    if kept != text:
        pending = path.with_name(path.name + ".partial")
        pending.write_text(kept)
        os.replace(pending, path)


def _strict_json(value: Any) -> Any:
    """`value` with every non-finite number as None: JSON has no NaN or infinity, and Python would
    write them anyway, as lines that jq, JavaScript and most JSON readers reject."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _strict_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_strict_json(item) for item in value]
    return value
