"""`python -m bench.paired {torch,deepspeed} --config CONFIG [--set PATH=VALUE ...]`: the engine and a
baseline (bench/baseline.py) trained in one process, step for step.

The engine runs as `python engine/main.py` runs it (`engine.session.run`: config checks, process group,
backend, and the training loop with its health check, logging and evaluation). After each of its
logged steps, `Pairing.after_step` runs as many steps of the baseline as the engine ran since the last
one. Each side's window is timed at these hand-overs, so a change in the load from elsewhere on a
shared machine (a burst, a noisy neighbour for a minute) falls on both sides alike instead of on one
side's whole trial, as it does when the two run one after the other. Windows rather than single
steps alternate so that each side finds its own weights in the CPU caches again after its first
step: stepping alternately one by one doubled both sides' step time on the 2-core CI machine. On a
GPU each hand-over synchronises the device, so each side is charged for its own kernels.

Writes <output_dir>/paired.json: both sides' window times, the baseline's loss at the end of each
window, its final validation loss (the engine's own are in metrics.jsonl) and the machine's facts,
so that a trial run on another machine (a lent GPU) is reported with that machine's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.baseline import LOOPS, Baseline, build_baseline, evaluate
from bench.machine import machine_facts
from engine.backends.base import StepHooks
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data, settle_vocabulary
from engine.session import run

PAIRED = "paired.json"


class Pairing(StepHooks):
    """The run's hooks: after every `log_interval` engine steps, as many baseline steps, each side's
    window timed."""

    def __init__(self, kind: str, config_path: str, overrides: list[str]):
        hardware = detect_hardware(local_world_size=1)
        config = load_config(config_path, overrides, world_size=1, hardware=hardware)
        self.bundle = load_data(config)
        self.config = settle_vocabulary(config, self.bundle)
        self.kind = kind
        self.window = self.config.trainer.log_interval
        self.device = torch.device("cuda", 0) if hardware.device_type == "cuda" else torch.device("cpu")
        self._synchronize = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        self.engine_windows: list[float] = []  # seconds of engine steps k*w+1 .. (k+1)*w, from k = 1 on
        self.baseline_windows: list[float] = []  # seconds of baseline steps k*w+1 .. (k+1)*w, from k = 0 on
        self.losses: list[tuple[int, float]] = []
        self._baseline: Baseline | None = None
        self._handed_back: float | None = None

    def after_step(self, step: int) -> None:
        if step % self.window:
            return
        self._synchronize()
        arrived = time.perf_counter()
        if self._handed_back is not None:
            self.engine_windows.append(arrived - self._handed_back)
        if self._baseline is None:
            # Built once the engine's process group exists, which the DeepSpeed baseline joins.
            self._baseline = build_baseline(self.kind, self.config, self.bundle, self.device)
        start = time.perf_counter()
        for _ in range(self.window):
            loss = self._baseline.step(self._baseline.batches)
        # The baseline's one host sync per window, as the engine all-reduces its loss at a log step.
        self.losses.append((step, loss.item()))
        self._synchronize()
        self.baseline_windows.append(time.perf_counter() - start)
        self._handed_back = time.perf_counter()

    def write(self) -> None:
        assert self._baseline is not None, "the engine ran fewer steps than one window"
        result = {
            "window": self.window,
            "engine_windows": self.engine_windows,
            "baseline_windows": self.baseline_windows,
            "baseline_losses": self.losses,
            "baseline_eval_loss": evaluate(self._baseline, self.device),
            "machine": machine_facts(torch.get_num_threads()),
        }
        (self.config.trainer.output_path / PAIRED).write_text(json.dumps(result) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(LOOPS))
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args(argv)
    pairing = Pairing(args.kind, args.config, args.overrides)
    code = run(args.config, args.overrides, hooks=pairing)
    if code == 0:
        pairing.write()
    return code


if __name__ == "__main__":
    sys.exit(main())
