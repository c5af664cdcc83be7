"""What a run leaves to look at besides metrics.jsonl: PNG plots drawn from that file, and the
same records as TensorBoard, CSV and W&B events through DeepSpeed's monitor. The launched runs
that check the monitor end to end are the shared ones in test_training.py (DeepSpeed) and
test_accelerate.py (accelerate)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import wandb
from PIL import Image

from engine.config import ConfigError, load_config
from engine.config.load import check_document
from engine.launch.hardware import Hardware
from engine.observability.metrics import MetricsLogger, read_records
from engine.observability.plots import write_plots
from engine.observability.sinks import DEEPSPEED_ENGINE_EVENTS, MonitorSink, record_events
from tests.support.launch import ROOT
from tests.support.monitor import JOB_NAME, csv_rows, csv_values, tensorboard_events, tensorboard_values
from tests.support.process_group import world_of_one  # noqa: F401 (a fixture: pytest finds it by name)

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=1)
GIB = 2**30


def synthetic_records(steps: int = 6, ranks: bool = True) -> list[dict]:
    """Records shaped as the loop writes them, with an evaluation at steps 3 and 6."""
    records = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss": 4.0 / (step + 0.5),
            "lr": 1e-3 * min(1.0, step / 3),
            "tokens_per_s": 1000.0 + step,
            "tflops_per_device": 0.01 * step,
            "step_time_s": 0.5,
            "skipped_steps": 0,
            "grad_norm": 1.0 / step,
            "time_data_s": 0.05,
            "time_forward_s": 0.15,
            "time_backward_s": 0.2,
            "time_step_s": 0.05,
        }
        if step % 3 == 0:
            record.update({"eval_loss": 4.5 / step, "eval_perplexity": 90.0 / step})
        if ranks:
            record["ranks"] = [
                {
                    "parameter_bytes": GIB // 4,
                    "gradient_bytes": GIB // 8,
                    "optimizer_bytes": GIB // 2,
                    "rss_bytes": GIB + rank * GIB // 10 + step * 2**20,
                }
                for rank in range(2)
            ]
        records.append(record)
    return records


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def assert_pngs(paths: list[Path]) -> None:
    for path in paths:
        assert path.stat().st_size > 0, path
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 0 and image.height > 0


def test_plots_cover_every_metric_the_file_holds(tmp_path: Path):
    write_metrics(tmp_path, synthetic_records())
    paths = write_plots(tmp_path)
    assert {path.name for path in paths} == {
        "loss.png",
        "eval.png",
        "lr.png",
        "grad_norm.png",
        "throughput.png",
        "step_time.png",
        "memory.png",
    }
    assert all(path.parent == tmp_path / "plots" for path in paths)
    assert_pngs(paths)


def test_plots_skip_only_what_the_file_lacks(tmp_path: Path):
    """An image run without per-rank records, phase timings, grad norms or evaluations."""
    records = [
        {"step": step, "loss": 2.0 / step, "lr": 0.1, "images_per_s": 50.0, "tflops_per_device": 0.001}
        for step in range(1, 5)
    ]
    write_metrics(tmp_path, records)
    paths = write_plots(tmp_path)
    assert {path.name for path in paths} == {"loss.png", "lr.png", "throughput.png"}
    assert_pngs(paths)


def test_plotting_a_directory_without_metrics_is_one_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        write_plots(tmp_path)


def test_a_half_written_last_record_is_no_record_and_a_resume_drops_it(tmp_path: Path):
    """A crash (or `python -m engine plot` racing the run) can meet the last line half written."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in synthetic_records(3)) + '{"step": 4, "lo')
    assert [record["step"] for record in read_records(path)] == [1, 2, 3]
    assert write_plots(tmp_path)

    logger = MetricsLogger(tmp_path, enabled=True, total_steps=5, start_step=3, progress_bar=False)
    logger.log({"step": 4, "loss": 1.0})
    logger.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_record_events_are_named_in_deepspeeds_style_at_samples_seen():
    record = {**synthetic_records(3)[-1], "loss_scale": 1024.0, "nonfinite": True, "note": "text"}
    events = {name: (value, x) for name, value, x in record_events(record, samples_per_step=8)}
    assert events["Train/Samples/loss"] == (record["loss"], 24)
    assert events["Train/Samples/eval_perplexity"] == (record["eval_perplexity"], 24)
    assert events["Memory/Samples/rank1/rss_gib"] == (record["ranks"][1]["rss_bytes"] / GIB, 24)
    assert events["Memory/Samples/rank0/optimizer_gib"] == (0.5, 24)
    # Only numbers become events; the step is the axis.
    assert not {"Train/Samples/step", "Train/Samples/nonfinite", "Train/Samples/note"} & events.keys()
    # What DeepSpeed's engine already writes under the same name is left to it.
    left = {name for name, _, _ in record_events(record, 8, DEEPSPEED_ENGINE_EVENTS)}
    assert "Train/Samples/lr" not in left and "Train/Samples/loss_scale" not in left
    assert "Train/Samples/loss" in left


def accelerate_config(output_dir: Path, *sets: str):
    overrides = ["trainer.backend=accelerate", f"trainer.output_dir={output_dir}", *sets]
    return load_config(ROOT / "configs/tiny_gpt.json", overrides, world_size=1, hardware=CPU)


@pytest.mark.usefixtures("world_of_one")
def test_monitor_sink_writes_csv_and_tensorboard_for_the_accelerate_backend(tmp_path: Path):
    config = accelerate_config(tmp_path, "tensorboard.enabled=true", "csv_monitor.enabled=true")
    deepspeed_config = config.deepspeed_config()
    for key in ("tensorboard", "csv_monitor"):
        assert deepspeed_config[key]["output_path"] == str(tmp_path / "monitor")
    sink = MonitorSink.from_config(deepspeed_config)
    assert sink.enabled
    records = synthetic_records()
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=6, start_step=0, progress_bar=False, sinks=[sink])
    for record in records:
        logger.log(record)
    logger.close()

    directory = tmp_path / "monitor" / JOB_NAME
    batch = deepspeed_config["train_batch_size"]
    for key in ("loss", "lr", "eval_loss", "time_forward_s"):
        expected = {r["step"] * batch: r[key] for r in records if key in r}
        assert csv_values(directory, f"Train/Samples/{key}") == expected
        assert tensorboard_values(directory, f"Train/Samples/{key}") == pytest.approx(expected, rel=1e-6)
    rss = {r["step"] * batch: r["ranks"][1]["rss_bytes"] / GIB for r in records}
    assert tensorboard_values(directory, "Memory/Samples/rank1/rss_gib") == pytest.approx(rss, rel=1e-6)


@pytest.mark.usefixtures("world_of_one")
def test_a_resumed_run_rewinds_csv_and_tensorboard_to_its_step(tmp_path: Path):
    """A run that logged steps 1-4 and crashed, resumed from its step-2 checkpoint, logs steps 3
    and 4 again (other values: another process, another machine). Each CSV file keeps one header
    and each step once, and TensorBoard's reader keeps only the resumed values."""
    config = accelerate_config(tmp_path, "tensorboard.enabled=true", "csv_monitor.enabled=true")
    deepspeed_config = config.deepspeed_config()
    crashed = synthetic_records(4)
    resumed = [{**record, "loss": -record["loss"]} for record in crashed[2:]]
    for start_step, records in ((0, crashed), (2, resumed)):
        sink = MonitorSink.from_config(deepspeed_config)
        logger = MetricsLogger(
            tmp_path, enabled=True, total_steps=4, start_step=start_step, progress_bar=False, sinks=[sink]
        )
        for record in records:
            logger.log(record)
        logger.close()

    directory = tmp_path / "monitor" / JOB_NAME
    batch = deepspeed_config["train_batch_size"]
    steps = [record["step"] * batch for record in [*crashed[:2], *resumed]]
    losses = [record["loss"] for record in [*crashed[:2], *resumed]]
    expected = [[str(step), str(loss)] for step, loss in zip(steps, losses, strict=True)]
    assert csv_rows(directory)["Train_Samples_loss"] == [["step", "loss"], *expected]
    for name, rows in csv_rows(directory).items():
        written = [int(row[0]) for row in rows[1:]]  # a second header would not parse
        assert rows[0][0] == "step" and written == sorted(set(written)), name
    events = tensorboard_events(directory, "Train/Samples/loss")
    assert [step for step, _ in events] == steps
    assert [value for _, value in events] == pytest.approx(losses, rel=1e-6)  # TensorBoard keeps float32
    assert [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == losses


@pytest.mark.usefixtures("world_of_one")
def test_no_sink_when_every_monitor_is_off(tmp_path: Path):
    assert not MonitorSink.from_config(accelerate_config(tmp_path).deepspeed_config()).enabled


@pytest.mark.usefixtures("world_of_one")
def test_wandb_sink_logs_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """wandb 0.31 writes no summary file offline and has no reader for its run log, so the check is
    that every event name and every logged loss (as wandb encodes values, JSON) is in that log."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = accelerate_config(tmp_path / "run", "wandb.enabled=true", "wandb.project=engine-test")
    sink = MonitorSink.from_config(config.deepspeed_config())
    records = synthetic_records(3)
    for record in records:
        sink.write(record)
    sink.close()
    # finish() can return before wandb's service process has written the log; teardown waits for it,
    # as interpreter exit does at the end of a run.
    wandb.teardown()
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    written = log.read_bytes()
    for name, _, _ in record_events(records[-1], 1):
        assert name.encode() in written, name
    for record in records:
        assert json.dumps(record["loss"]).encode() in written


def test_wandb_without_the_package_is_one_config_error(monkeypatch: pytest.MonkeyPatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    document = {
        "train_micro_batch_size_per_gpu": 2,
        "model": {"family": "gpt", "preset": "tiny"},
        "data": {"type": "synthetic"},
        "wandb": {"enabled": True},
    }
    with pytest.raises(ConfigError) as caught:
        check_document(document, 1, CPU)
    assert [issue.path for issue in caught.value.issues] == ["wandb.enabled"]
    assert "pip install wandb" in str(caught.value)
