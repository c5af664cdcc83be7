"""Counting what a training step costs the host: reads of the device, aten operations, graph breaks.

On a GPU every read of a device value (`.item()`, `bool(tensor)`, `.tolist()`, `.cpu()`) and every
`synchronize` makes the host wait until the device has run everything queued, so the host can no
longer run ahead and the GPU idles while the host prepares the next kernels. None of that needs a GPU
to be seen: the same calls happen on the CPU, where they can be counted.

`HostCounter` counts, while it is active:
- scalar reads: aten `_local_scalar_dense` (what `.item()`, `bool()`, `float()` and `int()` of a
  tensor dispatch to);
- copies to the host that do not dispatch on the CPU: `Tensor.tolist`, `Tensor.cpu`, `Tensor.numpy`;
  both except for values that live on the host on every device (`_host_side`);
- `synchronize` of DeepSpeed's accelerator and of torch.cuda;
- every aten operation but views (`detach`, `view`, `t`, ...), which launch no kernel: a stand-in
  for kernel launches.

`python -m bench.host_syncs --config C --out F [--loop] [--set PATH=VALUE ...]` runs the engine as
`engine/main.py` runs it (under any launcher) and counts over its steps that neither log, evaluate
nor save; with `--loop`, then a minimal PyTorch loop (bench/baseline.py) on the same config, in the
same process. Each rank writes its counts to F with `{rank}` replaced.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.backends.base import StepHooks

HOST_COPIES = ("tolist", "cpu", "numpy")
# Steps before the first counted one: allocations, DeepSpeed's first-step set-up, compilation.
WARMUP_STEPS = 2


def _host_side() -> bool:
    """Whether the read in progress is of a value that lives on the host on every device: torch's
    non-capturable optimizers reading their own step count (torch/optim/optimizer.py `_get_value`),
    or the data loader's sampler working on its indices (torch/utils/data)."""
    return any(
        (frame.name == "_get_value" and frame.filename.endswith("optimizer.py"))
        or "torch/utils/data/" in frame.filename
        for frame in traceback.extract_stack()
    )


class HostCounter(TorchDispatchMode):
    """Counts host reads of device values, synchronisations and aten operations while active."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()  # kind -> calls
        self.operations = 0
        self._patched: list[tuple[Any, str, Callable]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        if not func.is_view:
            self.operations += 1
        if func is torch.ops.aten._local_scalar_dense.default and not _host_side():
            self.syncs["scalar read"] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostCounter:
        for name in HOST_COPIES:
            self._wrap(torch.Tensor, name, f"Tensor.{name}")
        from deepspeed.accelerator import get_accelerator

        self._wrap(get_accelerator(), "synchronize", "synchronize")
        self._wrap(torch.cuda, "synchronize", "synchronize")
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name)
        counter = self.syncs

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not _host_side():
                counter[kind] += 1
            return original(*args, **kwargs)

        self._patched.append((owner, name, original))
        setattr(owner, name, counted)

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


class StepCounts:
    """Counts per counted step: syncs by kind, aten operations, host seconds (measured on steps
    run without the counter, whose dispatch would inflate them)."""

    def __init__(self) -> None:
        self.syncs: list[dict[str, int]] = []
        self.operations: list[int] = []
        self.seconds: list[float] = []

    @contextmanager
    def step(self, counted: bool) -> Iterator[None]:
        if not counted:
            start = time.perf_counter()
            yield
            self.seconds.append(time.perf_counter() - start)
            return
        with HostCounter() as counter:
            yield
        self.syncs.append(dict(counter.syncs))
        self.operations.append(counter.operations)

    def summary(self) -> dict[str, Any]:
        steps = len(self.operations)
        kinds: Counter[str] = Counter()
        for step in self.syncs:
            kinds.update(step)
        return {
            "counted_steps": steps,
            "syncs_per_step": sum(kinds.values()) / steps,
            "syncs_by_kind": {kind: count / steps for kind, count in kinds.items()},
            "operations_per_step": sum(self.operations) / steps,
            "seconds_per_step": sorted(self.seconds)[len(self.seconds) // 2] if self.seconds else None,
        }


class CountingHooks(StepHooks):
    """The engine's steps that neither log, evaluate nor save, after the warm-up: alternately counted
    and timed."""

    def __init__(self, log_interval: int, max_steps: int) -> None:
        self.counts = StepCounts()
        self._log_interval, self._max_steps = log_interval, max_steps
        self._step: AbstractContextManager[None] | None = None

    def before_step(self, step: int) -> None:
        quiet = step % self._log_interval and step < self._max_steps
        if step > WARMUP_STEPS and quiet:
            self._step = self.counts.step(counted=step % 2 == 1)
            self._step.__enter__()

    def after_step(self, step: int) -> None:
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def count_loop(config_path: str, overrides: list[str], steps: int) -> dict[str, Any]:
    """The minimal PyTorch loop (bench/baseline.py) on the engine's resolved config, counted as the
    engine's quiet steps are."""
    from bench.baseline import build_baseline
    from engine.config import load_config
    from engine.launch.hardware import detect_hardware
    from engine.preflight import load_data, settle_vocabulary

    hardware = detect_hardware(local_world_size=1)
    config = load_config(config_path, overrides, world_size=1, hardware=hardware)
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    device = torch.device("cuda", 0) if hardware.device_type == "cuda" else torch.device("cpu")
    # Fused AdamW, as the loop runs on a GPU (torch has the fused kernel on the CPU too).
    baseline = build_baseline("torch", config, bundle, device, fused=True)
    counts = StepCounts()
    for step in range(1, steps + 1):
        if step <= WARMUP_STEPS:
            baseline.step(baseline.batches)
            continue
        with counts.step(counted=step % 2 == 1):
            baseline.step(baseline.batches)
    return counts.summary()


def main(argv: list[str] | None = None) -> int:
    from engine.config import load_config
    from engine.launch.hardware import detect_hardware
    from engine.parallel.process_group import env_rank, env_world_size
    from engine.session import run

    parser = argparse.ArgumentParser(prog="python -m bench.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, help="where each rank writes its counts; {rank} is replaced")
    parser.add_argument("--loop", action="store_true", help="also count the minimal PyTorch loop (one process)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args(argv)
    world = env_world_size()
    trainer = load_config(args.config, args.overrides, world_size=world, hardware=detect_hardware(world)).trainer
    hooks = CountingHooks(trainer.log_interval, trainer.max_steps)
    code = run(args.config, args.overrides, hooks=hooks)
    if code != 0:
        return code
    result = {"engine": hooks.counts.summary(), "graph_breaks": graph_breaks()}
    if args.loop:
        result["loop"] = count_loop(args.config, args.overrides, trainer.max_steps)
        result["graph_breaks_loop"] = graph_breaks() - result["graph_breaks"]
    Path(args.out.format(rank=env_rank())).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
