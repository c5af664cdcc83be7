"""The baselines the engine is measured against: a minimal hand-written PyTorch loop and a minimal
raw DeepSpeed script.

Each builds what the engine builds from the same config (the family's model from the same seed,
the same data order, optimizer, LR schedule and clipping), so the only difference left is the
loop around forward, backward and step. bench/paired.py steps one of them between the engine's
steps, in the engine's own process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from data import DataBundle
from data.loader import make_eval_loader, make_train_loader
from engine.backends.optim import build_optimizer, build_scheduler, parameter_groups
from engine.config import EngineConfig
from models import ModelFamily, get_family
from models.parallelize import ParallelRequest
from models.seeding import seed_everything

Batch = dict[str, torch.Tensor]
StepFn = Callable[[Iterator[Batch]], torch.Tensor]


@dataclass
class Baseline:
    step: StepFn  # one optimizer step over the next micro-batches; the mean loss, on the device
    batches: Iterator[Batch]
    model: torch.nn.Module  # what `evaluate` runs: the module, or the DeepSpeed engine around it
    family: ModelFamily
    config: EngineConfig
    bundle: DataBundle


def torch_loop(
    model: torch.nn.Module, config: EngineConfig, family: ModelFamily, fused: bool | None = None
) -> tuple[StepFn, torch.nn.Module]:
    """Plain PyTorch as nanoGPT writes it: decay the matrices only (by the config's
    `trainer.weight_decay_on`), accumulate, clip, step the optimizer and the schedule, zero the
    gradients; bf16 as autocast over fp32 weights, torch's fused AdamW on a GPU, and
    `torch.compile` when the config asks the engine to compile. `fused`: the fused AdamW kernel
    (default: on a GPU only)."""
    doc = config.document
    device = next(model.parameters()).device
    if config.compute_precision not in ("fp32", "bf16"):
        raise SystemExit(f"the torch baseline trains in fp32 or bf16 (autocast), not {config.precision}")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.compute_precision == "bf16")
    groups = parameter_groups(model.parameters(), doc["optimizer"], config.trainer.weight_decay_on)
    optimizer = build_optimizer(doc["optimizer"], groups, fused=device.type == "cuda" if fused is None else fused)
    scheduler = build_scheduler(doc.get("scheduler"), optimizer)
    accumulation, clipping = config.batch.gradient_accumulation_steps, doc["gradient_clipping"]
    if config.trainer.compile:
        model.compile()

    def step(batches: Iterator[Batch]) -> torch.Tensor:
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            with autocast:
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
    """DeepSpeed as its tutorials use it, with the DeepSpeed keys of the engine's resolved config,
    in the process group the engine started."""
    import deepspeed

    ds_config = config.deepspeed_config()
    groups = parameter_groups(model.parameters(), ds_config["optimizer"], config.trainer.weight_decay_on)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    if config.trainer.compile:
        engine.compile()
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


LOOPS = {"torch": torch_loop, "deepspeed": deepspeed_loop}


def on_device(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    for batch in batches:
        yield {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def build_baseline(
    kind: str, config: EngineConfig, bundle: DataBundle, device: torch.device, fused: bool | None = None
) -> Baseline:
    """The `kind` ("torch" or "deepspeed") loop on the engine's resolved config and data; `fused`
    as `torch_loop` takes it."""
    family = get_family(config.model.family)
    trainer = config.trainer
    # The engine seeds right before it builds the model, so both start from the same weights.
    seed_everything(trainer.seed)
    options = {"fused": fused} if kind == "torch" else {}  # DeepSpeed's optimizer follows the config
    # Checkpointed as the engine's model is; the loop wraps and compiles it its own way.
    model = family.parallelize(
        family.build(config.model.fields), ParallelRequest(checkpointing=config.model.activation_checkpointing)
    )
    step, model = LOOPS[kind](model.to(device).train(), config, family, **options)
    batches = make_train_loader(
        bundle.train,
        micro_batch_size=config.batch.micro_batch_size,
        grad_accum=config.batch.gradient_accumulation_steps,
        dp_rank=0,
        dp_size=1,
        seed=trainer.seed,
        num_workers=config.data.num_workers,
        pin_memory=config.data.pin_memory,
    )
    return Baseline(step, on_device(batches, device), model, family, config, bundle)


def evaluate(baseline: Baseline, device: torch.device) -> float:
    """Mean validation loss over the engine's evaluation batches, summed in float64 as the engine sums."""
    config, model, family = baseline.config, baseline.model, baseline.family
    validation = make_eval_loader(
        baseline.bundle.validation,
        micro_batch_size=config.batch.micro_batch_size,
        dp_rank=0,
        dp_size=1,
        max_batches=config.trainer.eval_batches,
        num_workers=config.data.num_workers,
        pin_memory=config.data.pin_memory,
    )
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for batch in on_device(iter(validation), device):
            for key, value in family.eval_sums(model, batch).items():
                totals[key] = totals.get(key, 0) + value.detach().double()
    model.train()
    return family.summarize_eval({key: float(value) for key, value in totals.items()})["loss"]
