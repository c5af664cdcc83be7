"""The plan as text: the per-rank table with its verdict (`python -m engine plan`), the same facts
told rank by rank (`python -m engine explain`), and the layouts that fit (`--suggest`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import ConfigError, EngineConfig
from engine.plan.planner import Plan, format_bytes, plan_run


def table(plan: Plan) -> str:
    config = plan.config
    lines = [
        f"{config.model['family']} {config.model['preset']} on {config.world_size} rank(s): ZeRO-{config.zero_stage}, "
        f"{config.precision_label}, {config.trainer['backend']} backend; optimizer states per rank: {plan.adam_share}",
        f"{'rank':>4} {'stage':>5} {'tp':>3} {'dp':>3} {'parameters':>12} {'gradients':>12} {'optimizer':>12} "
        f"{'offloaded':>12} {'activations*':>13} {'device':>12} {'comm/step*':>12}",
    ]
    for rank in plan.ranks:
        states = rank.states
        lines.append(
            f"{rank.rank:>4} {rank.where.stage:>5} {rank.where.tensor:>3} {rank.where.data:>3} "
            f"{format_bytes(states.parameter):>12} {format_bytes(states.gradient):>12} "
            f"{format_bytes(states.optimizer):>12} {format_bytes(states.offloaded):>12} "
            f"{format_bytes(rank.activations):>13} {format_bytes(rank.device):>12} "
            f"{format_bytes(rank.communication.total):>12}"
        )
    other = "without" if plan.checkpointing else "with"
    if config.trainer["backend"] != "accelerate":
        rules = "DeepSpeed's partitioning and padding"
    elif config.zero_stage == 0:
        rules = "DDP holds every tensor whole"
    else:
        rules = "torch FSDP2's padded row pieces"
    lines.append(
        f"parameters, gradients and optimizer states are exact ({rules}); "
        f"* estimates: activations {'with' if plan.checkpointing else 'without'} activation checkpointing "
        f"({other} it: {format_bytes(max(r.activations_other for r in plan.ranks))} at most), "
        f"communication by ring collectives; pipeline bubble {plan.bubble:.1%}"
    )
    return "\n".join(lines)


def verdict(plan: Plan, device_memory: int | None, host_memory: int | None) -> tuple[bool, str]:
    """Whether the busiest rank fits the device and every rank's offloaded states fit the host."""
    budgets = [
        ("device", "on the busiest rank", plan.device_peak, device_memory),
        ("host", "offloaded by all ranks together", plan.host_total, host_memory),
    ]
    checked = [_budget(*budget) for budget in budgets if budget[3] is not None]
    return all(fits for fits, _ in checked), "\n".join(line for _, line in checked)


def _budget(memory: str, holder: str, needed: int, available: int) -> tuple[bool, str]:
    margin = available - needed
    outcome = f"fits, {format_bytes(margin)} to spare" if margin >= 0 else f"does not fit, {format_bytes(-margin)} over"
    return margin >= 0, f"{memory}: {format_bytes(needed)} {holder} of {format_bytes(available)}: {outcome}"


def explain(plan: Plan) -> str:
    config = plan.config
    layout_line = (
        f"{config.world_size} rank(s): {config.parallel['pipeline_parallel_size']} pipeline stage(s) x "
        f"{config.dp_size} data-parallel replica(s) x {config.parallel['tensor_parallel_size']} tensor shard(s), "
        f"ZeRO-{config.zero_stage}, {config.precision_label}"
    )
    lines = [layout_line]
    tensor, data = config.parallel["tensor_parallel_size"], config.dp_size
    stages = config.parallel["pipeline_parallel_size"]
    for rank in plan.ranks:
        states, where = rank.states, rank.where
        host = f", {format_bytes(states.offloaded)} of it in host memory" if states.offloaded else ""
        lines.append(
            f"rank {rank.rank}: stage {where.stage + 1} of {stages} ({rank.layers}), TP shard {where.tensor + 1} of "
            f"{tensor}, data-parallel replica {where.data + 1} of {data}, holds {plan.adam_share} of the optimizer "
            f"states: parameters {format_bytes(states.parameter)}, gradients {format_bytes(states.gradient)}, "
            f"optimizer {format_bytes(states.optimizer)}{host}; activations about {format_bytes(rank.activations)}; "
            f"sends about {format_bytes(rank.communication.total)} per step"
            + "".join(f", {name} {format_bytes(size)}" for name, size in rank.communication.data_parallel.items())
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Candidate:
    overrides: list[str]
    plan: Plan


def suggest(
    config: EngineConfig,
    load: Callable[[list[str]], EngineConfig],
    device_memory: int | None,
    host_memory: int | None,
) -> list[Candidate]:
    """Every layout of the same world size and global batch that is a valid config and fits,
    cheapest communication per step first (then least device memory). `load` validates overrides."""
    world = config.world_size
    divisors = [n for n in range(1, world + 1) if world % n == 0]
    micro = config.document["train_micro_batch_size_per_gpu"]
    micro_batches = sorted({m for m in (micro, micro // 2, micro // 4, 1) if m >= 1}, reverse=True)
    offloads = {"none": [], "optimizer": ["zero_optimization.offload_optimizer.device=cpu"]}
    offloads["optimizer+param"] = offloads["optimizer"] + ["zero_optimization.offload_param.device=cpu"]
    found = []
    for stage in (0, 1, 2, 3):
        for offload, offload_sets in offloads.items():
            if (offload != "none" and stage == 0) or (offload == "optimizer+param" and stage != 3):
                continue
            for tensor in divisors:
                for pipeline in divisors:
                    if world % (tensor * pipeline):
                        continue
                    for size in micro_batches:
                        for checkpointing in (False, True):
                            overrides = [
                                f"zero_optimization.stage={stage}",
                                "zero_optimization.offload_optimizer.device=none",
                                "zero_optimization.offload_param.device=none",
                                *offload_sets,
                                f"parallel.tensor_parallel_size={tensor}",
                                f"parallel.pipeline_parallel_size={pipeline}",
                                f"train_micro_batch_size_per_gpu={size}",
                                f"train_batch_size={config.document['train_batch_size']}",
                                "gradient_accumulation_steps=auto",
                                _checkpointing_override(config, pipeline, checkpointing),
                            ]
                            try:
                                plan = plan_run(load(overrides))
                            except (ConfigError, ValueError):
                                continue
                            fits, _ = verdict(plan, device_memory, host_memory)
                            if fits:
                                found.append(Candidate(overrides, plan))
    found.sort(key=lambda candidate: (candidate.plan.communication, candidate.plan.device_peak))
    return found


def _checkpointing_override(config: EngineConfig, pipeline: int, on: bool) -> str:
    if pipeline > 1:
        return f"parallel.pipeline_activation_checkpoint_interval={1 if on else 0}"
    if config.model["family"] == "gpt":
        return f"model.activation_checkpointing={'true' if on else 'false'}"
    return "parallel.pipeline_activation_checkpoint_interval=0"


def describe_candidate(candidate: Candidate) -> str:
    config, plan = candidate.plan.config, candidate.plan
    zero = config.document["zero_optimization"]
    offload = [name for name in ("optimizer", "param") if zero[f"offload_{name}"]["device"] != "none"]
    checkpointing = "on" if plan.checkpointing else "off"
    return (
        f"ZeRO-{config.zero_stage}"
        + (f" offload {'+'.join(offload)}" if offload else "")
        + f", TP {config.parallel['tensor_parallel_size']}, PP {config.parallel['pipeline_parallel_size']}, "
        f"micro-batch {config.document['train_micro_batch_size_per_gpu']} x "
        f"{config.document['gradient_accumulation_steps']}, checkpointing {checkpointing}: "
        f"device {format_bytes(plan.device_peak)}, host {format_bytes(plan.host_total)}, "
        f"comm {format_bytes(plan.communication)}/step\n    --set " + " --set ".join(candidate.overrides)
    )
