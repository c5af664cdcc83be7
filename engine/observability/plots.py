"""PNG plots of a run, drawn from its metrics.jsonl alone, so any finished or running run can be
plotted again later, on any machine, without TensorBoard.

Each plot is drawn only when the file holds its data (a ResNet run has no tokens/s, a run
without per-rank records no memory plot); none is drawn from anything else. matplotlib is
imported when plots are drawn, not when the engine starts, and through `Figure` rather than
pyplot: no display, no global figure state, the Agg renderer for PNG.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.observability.metrics import read_records

PLOTS_FOLDER = "plots"

# Phases of one step as the loop measures them, bottom to top of the stack.
_PHASES = ("data", "forward", "backward", "communication", "step")
_MODEL_STATE = ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
_PEAKS = ("rss_bytes", "device_allocated_peak_bytes", "device_reserved_peak_bytes")
_THROUGHPUT = {"tokens_per_s": "tokens/s", "images_per_s": "images/s"}
_GIB = 2**30
# Legends beside the axes, where they hide no data.
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": "small"}

Records = list[dict[str, Any]]


def read_metrics(run_dir: Path) -> Records:
    """The records of `<run_dir>/metrics.jsonl`; FileNotFoundError naming the directory if absent."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl: not a run directory, or no step was logged yet")
    return read_records(path)


def write_plots(run_dir: Path) -> list[Path]:
    """Draw every plot the run's metrics allow into `<run_dir>/plots/`; return the PNG paths."""
    records = read_metrics(run_dir)
    folder = Path(run_dir) / PLOTS_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in _DRAWERS.items():
        figure = draw(records)
        if figure is None:
            continue
        path = folder / f"{name}.png"
        figure.savefig(path, dpi=100)
        written.append(path)
    return written


def _series(records: Records, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold a number under `key`."""
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [step for step, _ in pairs], [value for _, value in pairs]


def _figure(rows: int = 1, title: str = "") -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 3.2 * rows), layout="constrained")
    axes = list(figure.subplots(rows, 1, squeeze=False)[:, 0])
    if title:
        figure.suptitle(title)
    for axis in axes:
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    return figure, axes


def _loss(records: Records) -> Any:
    steps, losses = _series(records, "loss")
    eval_steps, eval_losses = _series(records, "eval_loss")
    if not steps and not eval_steps:
        return None
    figure, (axis,) = _figure(title="Loss")
    if steps:
        axis.plot(steps, losses, label="train loss")
    if eval_steps:
        axis.plot(eval_steps, eval_losses, "o-", label="eval loss")
    axis.set_ylabel("loss")
    axis.legend()
    return figure


def _eval(records: Records) -> Any:
    """Evaluation metrics other than the loss (perplexity, accuracy), one panel each."""
    keys = sorted({key for r in records for key in r if key.startswith("eval_") and key != "eval_loss"})
    keys = [key for key in keys if _series(records, key)[0]]
    if not keys:
        return None
    figure, axes = _figure(len(keys), title="Evaluation")
    for axis, key in zip(axes, keys, strict=True):
        axis.plot(*_series(records, key), "o-")
        axis.set_ylabel(key.removeprefix("eval_"))
    return figure


def _single(key: str, title: str, ylabel: str) -> Callable[[Records], Any]:
    def draw(records: Records) -> Any:
        steps, values = _series(records, key)
        if not steps:
            return None
        figure, (axis,) = _figure(title=title)
        axis.plot(steps, values)
        axis.set_ylabel(ylabel)
        return figure

    return draw


def _throughput(records: Records) -> Any:
    candidates = (*_THROUGHPUT.items(), ("tflops_per_device", "TFLOP/s per device"), ("mfu", "MFU"))
    panels = [(key, label) for key, label in candidates if _series(records, key)[0]]
    if not panels:
        return None
    figure, axes = _figure(len(panels), title="Throughput (average since the previous logged step)")
    for axis, (key, label) in zip(axes, panels, strict=True):
        axis.plot(*_series(records, key))
        axis.set_ylabel(label)
    return figure


def _step_time(records: Records) -> Any:
    """The phases of the logged step stacked, under the window's average step time: the gap
    between them is time no phase accounts for."""
    phases = _phase_names(records)
    rows = [r for r in records if all(isinstance(r.get(f"time_{p}_s"), (int, float)) for p in phases)]
    if not phases or not rows:
        return None
    figure, (axis,) = _figure(title="Step time")
    steps = [r["step"] for r in rows]
    axis.stackplot(steps, *[[r[f"time_{p}_s"] for r in rows] for p in phases], labels=phases, alpha=0.8)
    average_steps, averages = _series(records, "step_time_s")
    if average_steps:
        axis.plot(average_steps, averages, "k--", label="step time (window average)")
    axis.set_ylabel("seconds")
    axis.legend(**_OUTSIDE)
    return figure


def _phase_names(records: Records) -> list[str]:
    """The <phase> of every `time_<phase>_s` key, in the order a step runs them."""
    found = {
        key.removeprefix("time_").removesuffix("_s")
        for r in records
        for key in r
        if key.startswith("time_") and key.endswith("_s") and len(key) > len("time__s")
    }
    return [p for p in _PHASES if p in found] + sorted(found - set(_PHASES))


def _memory(records: Records) -> Any:
    """Model-state bytes per rank (stacked) with RSS and device peaks at the last logged step, and
    the peaks of every rank over the run (a rising line is a leak)."""
    with_ranks = [r for r in records if r.get("ranks")]
    if not with_ranks:
        return None
    figure, (state_axis, time_axis) = _figure(2, title="Memory per rank")
    last = with_ranks[-1]["ranks"]
    labels = [f"rank {rank.get('rank', index)}" for index, rank in enumerate(last)]
    positions = list(range(len(last)))
    bottom = [0.0] * len(last)
    for key in _MODEL_STATE:
        values = [rank.get(key, 0) / _GIB for rank in last]
        if any(values):
            state_axis.bar(positions, values, bottom=bottom, label=key.removesuffix("_bytes"))
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for marker, key in zip(("ko", "r^", "ms"), _PEAKS, strict=True):
        values = [rank.get(key) for rank in last]
        if any(isinstance(value, (int, float)) for value in values):
            points = [(p, v / _GIB) for p, v in zip(positions, values, strict=True) if isinstance(v, (int, float))]
            state_axis.plot(*zip(*points, strict=True), marker, label=key.removesuffix("_bytes"))
    state_axis.set_xticks(positions, labels)
    state_axis.set_xlabel(f"rank (step {with_ranks[-1]['step']})")
    state_axis.set_ylabel("GiB")
    state_axis.legend(**_OUTSIDE)
    for key in _PEAKS:
        for index in positions:
            pairs = [
                (r["step"], r["ranks"][index][key] / _GIB)
                for r in with_ranks
                if index < len(r["ranks"]) and isinstance(r["ranks"][index].get(key), (int, float))
            ]
            if pairs:
                time_axis.plot(*zip(*pairs, strict=True), label=f"{labels[index]} {key.removesuffix('_bytes')}")
    time_axis.set_ylabel("GiB")
    time_axis.legend(**_OUTSIDE)
    return figure


_DRAWERS: dict[str, Callable[[Records], Any]] = {
    "loss": _loss,
    "eval": _eval,
    "lr": _single("lr", "Learning rate", "lr"),
    "grad_norm": _single("grad_norm", "Gradient norm", "grad norm"),
    "throughput": _throughput,
    "step_time": _step_time,
    "memory": _memory,
}
