"""`python -m bench [names...]`: run benchmarks (all by default), print each ratio next to its
goal, store the results in bench/results.json and rewrite docs/benchmarks.md and its plot.

A benchmark is a function from `Settings` to `Result`; adding one is a module and a line in
`BENCHMARKS` (report order)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from bench import (
    checkpointing,
    data,
    gpu,
    hostcost,
    infinity,
    memory,
    memory_walls,
    optimizer_step,
    sequence,
    sft,
    shakespeare,
    throughput,
)
from bench.report import REPORT, headline, load_results, store_results, write_report
from bench.results import Result, Unavailable
from bench.settings import Settings
from engine.config import ConfigError
from engine.preflight import RunError

BENCHMARKS: dict[str, Callable[[Settings], Result]] = {
    "overhead": throughput.versus_torch,  # 1: engine vs a minimal PyTorch loop
    "deepspeed": throughput.versus_deepspeed,  # 2: engine vs a minimal raw DeepSpeed script
    "shakespeare": shakespeare.run,  # 3: quality and speed on tinyshakespeare
    "memory": memory.run,  # 4: model-state bytes per rank against the ZeRO formulas
    "gpu": gpu.speed,  # 5: GPT-2 124M tokens/s and MFU on one GPU
    # 5: the largest GPT that trains on one GPU with ZeRO-Offload; without a GPU, under a host-memory
    # cap with ZeRO-3's NVMe offload against its CPU offload
    "offload": infinity.run,
    "optimizer": optimizer_step.run,  # 6: host cost of the optimizer step, bf16 against torch_autocast
    "data": data.run,  # 7: tokenized corpora: preparation speed, launch time and memory per rank against size
    "hostcost": hostcost.run,  # 8: host reads of the device, aten operations and graph breaks per step
    "checkpointing": checkpointing.run,  # 9: training time lost per save, sync and async; SIGTERM to exit
    "sft": sft.run,  # 10: chat fine-tuning with LoRA against TRL's SFTTrainer: tokens/s and loss
    "sequence": sequence.run,  # 11: memory per rank against sequence length, SP 1 and SP 2; step time ratio
    # 12: a 128,256-token vocabulary: the loss's memory and step time, full and fused, and each
    # activation-checkpointing choice, beside the planner's figures
    "memory-walls": memory_walls.run,
}


def _count(text: str) -> int:
    """A count of rounds, steps or threads: zero would leave a benchmark with nothing to take a median of."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_settings(argv: list[str] | None) -> tuple[list[str], Settings]:
    """The benchmarks to run (none with --report-only) and the settings they share."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--rounds", type=_count, default=5, help="paired trials (fresh processes) per speed benchmark")
    parser.add_argument("--steps", type=_count, default=300, help="steps per speed trial, the first interval untimed")
    parser.add_argument("--log-interval", type=_count, default=25, help="steps between log records in speed trials")
    parser.add_argument("--quality-steps", type=_count, default=2000, help="training steps of benchmark 3")
    parser.add_argument("--quality-rounds", type=_count, default=1, help="paired trials of benchmark 3")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from stored results")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser.add_argument("--threads", type=_count, default=cores, help="CPU threads of every side (default: all cores)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    if args.steps < 2 * args.log_interval:
        parser.error("--steps must be at least twice --log-interval: the first interval is not timed")
    settings = Settings(
        rounds=args.rounds,
        steps=args.steps,
        log_interval=args.log_interval,
        quality_steps=args.quality_steps,
        quality_rounds=args.quality_rounds,
        threads=args.threads,
    )
    return [] if args.report_only else args.names or list(BENCHMARKS), settings


def main(argv: list[str] | None = None) -> int:
    names, settings = parse_settings(argv)
    (results, history), failed = load_results(), []
    for name in names:
        print(f"{name}: running", flush=True)
        try:
            result = BENCHMARKS[name](settings)
        except Unavailable as reason:
            print(f"{name}: not run on this machine: {reason}", flush=True)
            continue
        except (ConfigError, RunError, RuntimeError) as error:
            # One benchmark's missing data or failed run should not cost the others' figures.
            print(f"{name}: failed: {error}", file=sys.stderr, flush=True)
            failed.append(name)
            continue
        print(result.summary(), flush=True)
        if result.failures:
            failed.append(name)
        results[name] = result
        history.append(headline(result))
        store_results(results, history)
    write_report([results[name] for name in BENCHMARKS if name in results], history)
    print(f"wrote {REPORT}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
