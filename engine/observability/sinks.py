"""Where rank 0's metrics go besides metrics.jsonl: TensorBoard, CSV and W&B, written by
DeepSpeed's own monitor (`deepspeed.monitor.monitor.MonitorMaster`) from the config's
`tensorboard`, `csv_monitor` and `wandb` keys, exactly as a DeepSpeed user configures them.

Under the DeepSpeed backend the engine's monitor is reused rather than a second one built: one
writer per directory, and DeepSpeed's own `Train/Samples/...` events land beside the engine's.
The accelerate backend has no DeepSpeed engine, so a monitor is built from the same keys.

Events are placed where DeepSpeed places its own: `Train/Samples/<metric>` at x = samples seen
(step x global batch). W&B drops any event whose step is lower than one already logged, and
DeepSpeed logs at the sample count; events at the optimizer step would vanish from W&B.

A run resumed in the directory of an earlier one rewinds the CSV and TensorBoard files to the
step it resumes from, as it rewinds metrics.jsonl, so that the steps a crash lost after the last
checkpoint are not there twice. W&B needs nothing: DeepSpeed starts a new W&B run in each process.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.csv_monitor import csvMonitor
from deepspeed.monitor.monitor import MonitorMaster
from deepspeed.monitor.tensorboard import TensorBoardMonitor

from engine.observability.metrics import Sink

# DeepSpeed's engine writes these itself after every optimizer step, under the same names; the
# engine's copies would put a second point at each x (and its lr is the one the step used, one
# step behind DeepSpeed's).
DEEPSPEED_ENGINE_EVENTS = frozenset({"lr", "loss_scale"})

_NOT_EVENTS = frozenset({"step", "time", "ranks"})
_GIB = 2**30

Event = tuple[str, float, int]


def record_events(
    record: dict[str, Any], samples_per_step: int, leave_out: frozenset[str] = frozenset()
) -> list[Event]:
    """A metrics record as monitor events: every numeric value, and each rank's memory in GiB
    as `Memory/Samples/rank<r>/<name>_gib` (bytes are unreadable on a TensorBoard axis)."""
    samples = record["step"] * samples_per_step
    events = [
        (f"Train/Samples/{key}", value, samples)
        for key, value in record.items()
        if key not in _NOT_EVENTS and key not in leave_out and _is_number(value)
    ]
    for index, rank in enumerate(record.get("ranks", [])):
        number = rank.get("rank", index)
        for key, value in rank.items():
            if key == "rank" or not _is_number(value):
                continue
            if key.endswith("_bytes"):
                key, value = key.removesuffix("_bytes") + "_gib", value / _GIB
            events.append((f"Memory/Samples/rank{number}/{key}", value, samples))
    return events


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MonitorSink:
    """Writes each metrics record through a DeepSpeed MonitorMaster (which acts on rank 0 only)."""

    def __init__(self, monitor: MonitorMaster, samples_per_step: int, leave_out: frozenset[str] = frozenset()) -> None:
        self.monitor = monitor
        self.samples_per_step = samples_per_step
        self.leave_out = leave_out

    @classmethod
    def from_config(cls, deepspeed_config: dict[str, Any]) -> MonitorSink:
        """A monitor of its own, for a backend without a DeepSpeed engine; needs deepspeed.comm
        initialised (engine.parallel.process_group.init_process_group does it on every backend)."""
        monitor = MonitorMaster(get_monitor_config(deepspeed_config))
        return cls(monitor, deepspeed_config["train_batch_size"])

    @property
    def enabled(self) -> bool:
        return self.monitor.enabled

    def write(self, record: dict[str, Any]) -> None:
        self.monitor.write_events(record_events(record, self.samples_per_step, self.leave_out))

    def rewind(self, step: int) -> None:
        last = step * self.samples_per_step
        if self.monitor.csv_monitor is not None:
            _rewind_csv(self.monitor.csv_monitor, last)
        if self.monitor.tb_monitor is not None:
            _purge_tensorboard(self.monitor.tb_monitor, last + 1)

    def close(self) -> None:
        """TensorBoard events are flushed after every write already (DeepSpeed's default), so a
        rank ended by os._exit loses nothing; closing releases the file. W&B's run is finished
        here, so its files are complete when the run returns, not only at interpreter exit."""
        if self.monitor.tb_monitor is not None and self.monitor.tb_monitor.summary_writer is not None:
            self.monitor.tb_monitor.summary_writer.close()
        if self.monitor.wandb_monitor is not None:
            import wandb

            wandb.finish()


def _rewind_csv(monitor: csvMonitor, last: int) -> None:
    """Keep each file's header and its rows up to x = `last`. csvMonitor appends, and heads every
    file it has not yet written in this process, so a resumed run would repeat the lost steps under
    a second header; the files kept are marked as written."""
    for path in sorted(Path(monitor.log_dir).glob("*.csv")):
        with open(path, newline="") as handle:
            rows = list(csv.reader(handle))
        if not rows:
            continue
        kept = [rows[0], *(row for row in rows[1:] if row and row[0] != "step" and float(row[0]) <= last)]
        if len(kept) != len(rows):
            with open(path, "w", newline="") as handle:
                csv.writer(handle).writerows(kept)
        monitor.filenames.append(path.stem)


def _purge_tensorboard(monitor: TensorBoardMonitor, first: int) -> None:
    """TensorBoard's reader drops every earlier event at x >= `first` when a later one is a
    SessionLog START at `first` (for event files of version 2 it looks for nothing else). It is
    what torch's `SummaryWriter(purge_step=...)` writes; DeepSpeed builds its writer without one."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # installed whenever TensorBoard is on

    monitor.summary_writer.file_writer.add_event(Event(step=first, session_log=SessionLog(status=SessionLog.START)))
    monitor.summary_writer.flush()


def build_sinks(deepspeed_config: dict[str, Any], monitor: MonitorMaster | None) -> list[Sink]:
    """The sinks a run's config asks for (none when every monitor is off); `monitor` is the DeepSpeed
    engine's own where one runs (`Backend.deepspeed_monitor`)."""
    if monitor is not None:
        sink = MonitorSink(monitor, deepspeed_config["train_batch_size"], DEEPSPEED_ENGINE_EVENTS)
    else:
        sink = MonitorSink.from_config(deepspeed_config)
    return [sink] if sink.enabled else []
