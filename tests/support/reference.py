"""The single-process reference every parallel mode is compared with: a plain PyTorch loop
(torch optimizer, explicit accumulation and clipping) over exactly the micro-batches the
ranks of a data-parallel run read, walked one after another in one process."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from data.loader import make_eval_loader, make_train_loader
from engine.backends.optim import build_optimizer, build_scheduler, parameter_groups
from engine.config import EngineConfig, load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data, settle_vocabulary
from models import get_family
from models.labels import IGNORE_INDEX
from models.parallelize import ParallelRequest
from models.seeding import seed_everything

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ReferenceRun:
    config: EngineConfig
    losses: list[float]
    grad_norms: list[float]  # each step's global gradient norm before clipping
    model: torch.nn.Module
    # A decoder's next-token loss after the last step, over every rank's validation batches, summed
    # by cross-entropy here rather than by the model family's code; None for ResNet, whose BatchNorm
    # statistics differ per rank under data parallelism.
    eval_loss: float | None
    validation: Dataset  # the validation set the evaluation read

    def evaluate(self, model: torch.nn.Module) -> float:
        """`model`'s next-token loss on the batches this reference evaluates on (an export, loaded
        with transformers, against the run that wrote it)."""
        dp = self.config.dp_size
        micro_batch = self.config.document["train_micro_batch_size_per_gpu"]
        return _evaluate(model, self.validation, micro_batch, dp, self.config)


def reference_run(config_path: str, overrides: dict[str, object], world_size: int) -> ReferenceRun:
    from tests.support.launch import _text

    config = load_config(
        ROOT / config_path,
        [f"{key}={_text(value)}" for key, value in overrides.items()],
        world_size=world_size,
        hardware=detect_hardware(local_world_size=world_size),
    )
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    doc, trainer = config.document, config.trainer
    family = get_family(config.model.family)
    # Same per-rank thread count as the launched ranks, so CPU kernels reduce in the same order.
    torch.set_num_threads(trainer.threads_per_rank)
    seed_everything(trainer.seed)
    # One process: the family's parallelize step checkpoints as the run asks and wraps nothing.
    model = family.parallelize(
        family.build(config.model.fields), ParallelRequest(checkpointing=config.model.activation_checkpointing)
    )
    model.train()
    offload = (
        doc["zero_optimization"]["offload_optimizer"]["device"] != "none"
        and trainer.backend == "deepspeed"
        and not doc["optimizer"]["params"].get("torch_adam")
    )
    # Under optimizer offload DeepSpeed runs its C++ CPU Adam (torch's with torch_adam), whose
    # arithmetic differs from torch's Adam in the last bit; the reference uses the same class, so
    # the comparison measures what ZeRO and offload do (partitioning, moving, reducing), not two
    # Adam kernels.
    groups = parameter_groups(model.parameters(), doc["optimizer"], trainer.weight_decay_on)
    if doc["optimizer"]["params"].get("bias_correction") is False and not offload:
        optimizer = UncorrectedAdam.from_section(groups, doc["optimizer"])
    else:
        optimizer = build_optimizer(doc["optimizer"], groups, cpu_adam=offload)
    scheduler = build_scheduler(doc.get("scheduler"), optimizer)
    accumulation, dp = doc["gradient_accumulation_steps"], config.dp_size
    loaders = [
        make_train_loader(
            bundle.train,
            micro_batch_size=doc["train_micro_batch_size_per_gpu"],
            grad_accum=accumulation,
            dp_rank=rank,
            dp_size=dp,
            seed=trainer.seed,
        )
        for rank in range(dp)
    ]
    losses, grad_norms = [], []
    for _ in range(trainer.max_steps):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(accumulation):
            for loader in loaders:
                # DeepSpeed's torch_autocast: the forward (loss included) under autocast, weights in fp32.
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast):
                    loss = family.compute_loss(model, next(loader))
                (loss / (accumulation * dp)).backward()
                total += loss.item()
        grad_norms.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
        )
        if doc["gradient_clipping"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), doc["gradient_clipping"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / (accumulation * dp))
    eval_loss = None
    if family.samples == "tokens":
        eval_loss = _evaluate(model, bundle.validation, doc["train_micro_batch_size_per_gpu"], dp, config)
    return ReferenceRun(config, losses, grad_norms, model, eval_loss, bundle.validation)


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam without bias correction (`optimizer.params.bias_correction: false`, as DeepSpeedExamples'
    BERT configs train), which torch's Adam has no switch for: the update DeepSpeed's FusedAdam and CPU
    Adam kernels make with bias_correction 0, written out so the reference does not run DeepSpeed's
    kernel to check DeepSpeed's kernel. With m and v the moving averages as they are,
    p -= lr * (m / (sqrt(v) + eps) + weight_decay * p) when decay is decoupled (AdamW), or
    weight_decay * p is added to the gradient first (Adam with adam_w_mode false)."""

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        decoupled: bool,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.decoupled = decoupled

    @classmethod
    def from_section(cls, groups: list[dict[str, Any]], section: dict[str, Any]) -> UncorrectedAdam:
        """The optimizer a resolved `optimizer` section describes; DeepSpeed runs "Adam" as AdamW unless
        adam_w_mode is false."""
        params = section["params"]
        decoupled = section["type"] == "AdamW" or params.get("adam_w_mode", True)
        return cls(groups, params["lr"], params["betas"], params["eps"], params["weight_decay"], decoupled)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            decay = group["weight_decay"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                grad = parameter.grad if self.decoupled else parameter.grad + decay * parameter
                state = self.state[parameter]
                if not state:
                    state["exp_avg"] = torch.zeros_like(parameter)
                    state["exp_avg_sq"] = torch.zeros_like(parameter)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
                if self.decoupled:
                    update += decay * parameter
                parameter -= group["lr"] * update


def _evaluate(model: torch.nn.Module, validation: Dataset, micro_batch: int, dp: int, config: EngineConfig) -> float:
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.autocast):
        for rank in range(dp):
            loader = make_eval_loader(
                validation,
                micro_batch_size=micro_batch,
                dp_rank=rank,
                dp_size=dp,
                max_batches=config.trainer.eval_batches,
            )
            for batch in loader:
                logits = model(input_ids=batch["input_ids"]).logits.float()
                labels = batch["labels"]
                # Samples repeated to fill every rank's batches carry IGNORE_INDEX labels, which count nothing.
                loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
                tokens += int((labels != IGNORE_INDEX).sum())
    model.train()
    return float(loss_sum / tokens)
