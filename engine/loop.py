"""The training loop: fetch a batch, forward, backward, step, check, log, evaluate, checkpoint.

Everything below works on values that stay on the device: a step that does not log, evaluate or
save never waits for the device. The non-finite check is read at those points, before anything of a
bad step is logged or saved (engine/failures/nonfinite.py), except where the policy must decide at
every step ("skip", fp16's loss scaler).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.backends.base import Backend, StepHooks
from engine.failures.nonfinite import SKIP, DeferredHealth, NonfiniteGuard, NonfinitePolicy, step_health
from engine.failures.preemption import StopRequests
from engine.observability.flops import achieved_flops_per_device, mfu
from engine.observability.memory import rank_memory
from engine.observability.metrics import MetricsLogger
from engine.observability.step_phases import PhaseTimer
from engine.parallel.process_group import all_reduce_sum, gather_to_main
from models import ModelFamily


@dataclass(frozen=True)
class LoopSettings:
    """What the step loop needs, settled by the trainer: the loop reads no config."""

    max_steps: int
    log_interval: int
    eval_interval: int
    save_interval: int
    items_per_step: int  # tokens (GPT) or images (ResNet) in one global batch
    throughput_key: str  # "tokens_per_s" or "images_per_s"
    world_size: int
    nonfinite: NonfinitePolicy
    flops_per_item: int  # model FLOPs to train on one token or image (ModelFamily.flops_per_item)
    peak_flops: float | None  # one device's dense peak, None where no MFU is claimed
    parameters: int = 0  # the model's, for a save's duration before one is measured
    stops: StopRequests | None = field(default=None, compare=False)  # signals and trainer.max_wall_time


class Saver(Protocol):
    """Where the loop's checkpoints go (engine.checkpoints.manager.CheckpointManager)."""

    last_save_s: float | None  # the last save's duration, for trainer.max_wall_time's margin

    def save(self, step: int) -> None: ...

    def settle(self, wait: bool) -> None: ...


@dataclass(frozen=True)
class LoopEnd:
    """How the loop ended: the last step saved, and why it stopped before max_steps (None: it did not)."""

    saved: int
    stopped: str | None = None


def evaluate(
    backend: Backend,
    family: ModelFamily,
    batches: Iterable[Mapping[str, torch.Tensor]],
    stops: StopRequests | None = None,
) -> dict:
    """Metrics over the validation batches of every rank (sums reduced, then averaged). A signal cuts
    the evaluation short at the same batch on every rank; its metrics are then left out."""
    if stops is not None:
        batches = stops.until_signalled(batches)
    sums = backend.eval_sums(batches)
    if stops is not None and stops.cut_short:
        return {}
    sums = all_reduce_sum(sums)
    return {f"eval_{key}": value for key, value in family.summarize_eval(sums).items()}


def train(
    backend: Backend,
    family: ModelFamily,
    batches: Iterator[Mapping[str, torch.Tensor]],
    eval_batches: Callable[[], Iterable[Mapping[str, torch.Tensor]]],
    settings: LoopSettings,
    logger: MetricsLogger,
    saver: Saver,
    start_step: int,
    hooks: StepHooks,
) -> LoopEnd:
    """Run from `start_step` to `settings.max_steps`, or until `settings.stops` asks for a stop with a
    save; returns how it ended, every save published. `hooks` are called around each optimizer step.
    A save written in the background (trainer.async_save) is published at a later step boundary."""
    step, saved = start_step, start_step
    stops = settings.stops
    window_start, window_steps = time.perf_counter(), 0
    guard = NonfiniteGuard(settings.nonfinite)
    deferred = None if every_step_decides(backend, settings) else DeferredHealth(backend.device)
    while step < settings.max_steps:
        boundary = time.perf_counter()
        lr = backend.learning_rate()
        hooks.before_step(step + 1)
        eval_due = step + 1 == settings.max_steps or (
            settings.eval_interval and (step + 1) % settings.eval_interval == 0
        )
        logged = eval_due or (step + 1) % settings.log_interval == 0
        skipped_before = backend.skipped_steps()
        loss = backend.train_step(batches, PhaseTimer(backend.device) if logged else None)
        step += 1
        window_steps += 1
        dropped = backend.skipped_steps() > skipped_before
        save_due = step == settings.max_steps or (settings.save_interval and step % settings.save_interval == 0)
        if deferred is None:
            note = guard.check(step, step_health(loss, update_dropped=dropped), backend.loss_scale())
            if note is not None:
                logger.write(note)
        else:
            deferred.record(step, loss, backend.nonfinite_gradients(), dropped)
            if logged or save_due:
                first_bad = deferred.read()
                if first_bad is not None:
                    guard.check(*first_bad, loss_scale=None)
        hooks.after_step(step)

        if logged:
            elapsed = time.perf_counter() - window_start
            record = {
                "step": step,
                "loss": all_reduce_sum({"loss": loss})["loss"] / settings.world_size,
                "lr": lr,
                **step_metrics(backend, settings, elapsed, window_steps),
                "skipped_steps": guard.skipped,
            }
            if eval_due:
                hooks.before_eval(step)
                record.update(evaluate(backend, family, eval_batches(), stops))
            ranks = gather_to_main(rank_memory(backend.state_watch))
            if ranks is not None:
                record["ranks"] = ranks
            logger.log(record)
            window_start, window_steps = time.perf_counter(), 0
        step_s = time.perf_counter() - boundary
        if save_due:
            saver.save(step)
            saved = step
        else:
            saver.settle(wait=False)
        reason = None if stops is None else stops.reason_to_stop(step_s, saver.last_save_s, settings.parameters)
        if reason is not None and step < settings.max_steps:
            if saved != step:
                if deferred is not None and (first_bad := deferred.read()) is not None:
                    guard.check(*first_bad, loss_scale=None)  # never save a step that went bad
                saver.save(step)
                saved = step
            saver.settle(wait=True)
            logger.write(f"{reason}: saved step {step} and stopped (exit code 75)")
            return LoopEnd(saved, reason)
    saver.settle(wait=True)
    return LoopEnd(saved)


def every_step_decides(backend: Backend, settings: LoopSettings) -> bool:
    """Whether the non-finite policy needs each step's health before the next step: "skip" counts
    every dropped step against its limit, and fp16's overflows are reported as they happen."""
    return settings.nonfinite.action == SKIP or backend.loss_scale() is not None


def step_metrics(backend: Backend, settings: LoopSettings, elapsed: float, steps: int) -> dict:
    """Speed over the steps since the last log, and the last step's norm, phases and loss scale.

    The window ends at the log point's loss all-reduce, which waits for the device, so throughput
    is the honest average over the window's steps."""
    items_per_s = settings.items_per_step * steps / elapsed
    metrics = {
        settings.throughput_key: items_per_s,
        "tflops_per_device": achieved_flops_per_device(settings.flops_per_item, items_per_s, settings.world_size)
        / 1e12,
        "step_time_s": elapsed / steps,
    }
    if settings.peak_flops is not None:
        metrics["mfu"] = mfu(settings.flops_per_item, items_per_s, settings.peak_flops, settings.world_size)
    grad_norm = backend.grad_norm()
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm
    for phase, seconds in (backend.step_breakdown() or {}).items():
        metrics[f"time_{phase}_s"] = seconds
    loss_scale = backend.loss_scale()
    if loss_scale is not None:
        metrics["loss_scale"] = loss_scale
    return metrics
