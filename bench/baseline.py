"""The baselines the engine is measured against: a minimal hand-written PyTorch loop and a minimal
raw DeepSpeed script, each run as its own process like the engine.

`python -m bench.baseline {torch,deepspeed} --config CONFIG [--set k=v ...]`

Both build what the engine builds from the same config (the family's model from the same seed,
the same data order, optimizer, LR schedule and clipping, the same thread count), so the only
difference left is the loop around forward, backward and step. They log like the engine does:
a `metrics.jsonl` record (`step`, `loss`, `step_time_s` averaged since the last record) every
`trainer.log_interval` steps, the last with `eval_loss` over `trainer.eval_batches` validation
batches, in `trainer.output_dir`, so one reader times both sides over the same steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from data import make_eval_loader, make_train_loader
from engine.config import EngineConfig, load_config
from engine.hardware import detect_hardware
from engine.optim import build_optimizer, build_scheduler
from engine.run import load_data, seed_everything, settle_vocabulary
from models import ModelFamily, get_family

Batch = dict[str, torch.Tensor]
StepFn = Callable[[Iterator[Batch]], torch.Tensor]


def torch_loop(model: torch.nn.Module, config: EngineConfig, family: ModelFamily) -> tuple[StepFn, torch.nn.Module]:
    """Plain PyTorch: accumulate, clip, step the optimizer and the schedule, zero the gradients."""
    doc = config.document
    optimizer = build_optimizer(doc["optimizer"], model.parameters())
    scheduler = build_scheduler(doc.get("scheduler"), optimizer)
    accumulation, clipping = doc["gradient_accumulation_steps"], doc["gradient_clipping"]
    device = next(model.parameters()).device

    def step(batches: Iterator[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            loss = family.compute_loss(model, next(batches))
            (loss / accumulation).backward()
            total += loss.detach()
        if clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clipping)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return total / accumulation

    return step, model


def deepspeed_loop(model: torch.nn.Module, config: EngineConfig, family: ModelFamily) -> tuple[StepFn, torch.nn.Module]:
    """DeepSpeed as its tutorials use it, with the DeepSpeed keys of the engine's resolved config."""
    import deepspeed

    start_single_process_group()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config.deepspeed_config())
    accumulation = engine.gradient_accumulation_steps()

    def step(batches: Iterator[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=engine.device)
        for _ in range(accumulation):
            loss = family.compute_loss(engine, next(batches))
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        return total / accumulation

    return step, engine


def start_single_process_group() -> None:
    """A world of one, as `deepspeed.initialize` needs a process group even for one process.

    On CPU DeepSpeed maps a 66 MiB /dev/shm file per rank that it never removes; every mapping
    exists once `init_distributed` returns, so the name is removed at once (as the engine does)."""
    import deepspeed

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_0"):
        path.unlink(missing_ok=True)


LOOPS = {"torch": torch_loop, "deepspeed": deepspeed_loop}


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    for batch in batches:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def evaluate(model: torch.nn.Module, family: ModelFamily, batches: Iterator[Batch]) -> float:
    """Mean validation loss, summed in float64 over the batches as the engine sums them."""
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch in batches:
            for key, value in family.eval_sums(model, batch).items():
                totals[key] = totals.get(key, 0) + value.detach().double()
    model.train()
    return family.summarize_eval({key: float(value) for key, value in totals.items()})["loss"]


def train(step: StepFn, batches: Iterator[Batch], max_steps: int, log_interval: int) -> list[dict]:
    """The records the engine would log: the step's loss and the mean step time since the last record."""
    records = []
    window_start, window_first = time.perf_counter(), 1
    for number in range(1, max_steps + 1):
        loss = step(batches)
        if number % log_interval == 0 or number == max_steps:
            # .item() is this loop's only host sync, at log points, where the engine all-reduces its loss.
            record = {"step": number, "loss": loss.item()}
            record["step_time_s"] = (time.perf_counter() - window_start) / (number - window_first + 1)
            records.append(record)
            window_start, window_first = time.perf_counter(), number + 1
    return records


def run(kind: str, config_path: str, overrides: list[str]) -> None:
    config = load_config(config_path, overrides, world_size=1, hardware=detect_hardware(local_world_size=1))
    if config.precision != "fp32":
        raise SystemExit(f"the {kind} baseline trains in fp32 only; the config asks for {config.precision}")
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    doc, trainer = config.document, config.trainer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(trainer["threads_per_rank"])
    family = get_family(config.model["family"])
    # The engine seeds right before it builds the model, so both start from the same weights.
    seed_everything(trainer["seed"])
    step, model = LOOPS[kind](family.build(config.model).to(device).train(), config, family)
    micro_batch = doc["train_micro_batch_size_per_gpu"]
    batches = on_device(
        make_train_loader(
            bundle.train,
            micro_batch_size=micro_batch,
            grad_accum=doc["gradient_accumulation_steps"],
            dp_rank=0,
            dp_size=1,
            seed=trainer["seed"],
            num_workers=config.data["num_workers"],
        ),
        device,
    )
    validation = make_eval_loader(
        bundle.validation,
        micro_batch_size=micro_batch,
        dp_rank=0,
        dp_size=1,
        max_batches=trainer["eval_batches"],
        num_workers=config.data["num_workers"],
    )

    records = train(step, batches, trainer["max_steps"], trainer["log_interval"])
    records[-1]["eval_loss"] = evaluate(model, family, on_device(iter(validation), device))
    output_dir = Path(trainer["output_dir"])
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "resolved_config.json").write_text(json.dumps(doc, indent=2) + "\n")
    (output_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(LOOPS))
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args(argv)
    run(args.kind, args.config, args.overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
