"""The plan as text: the per-rank table with its verdict (`python -m engine plan`), the same facts
told rank by rank (`python -m engine explain`), and the layouts that fit (`--suggest`)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from engine.config import ConfigError, EngineConfig
from engine.launch.hardware import Hardware
from engine.observability.units import format_bytes
from engine.plan.data import DataSizes
from engine.plan.planner import Plan, nvme_bytes, plan_run, swap_paths, zero_settings
from engine.plan.states import StateBytes
from models import get_family
from models.activation_checkpointing import SUGGESTED


def table(plan: Plan) -> str:
    """Where the device is the host (`plan.one_pool`), the last memory column is everything a rank
    holds, under "host", rather than what sits on a device. An "nvme" column, the swap files each
    rank writes, appears only where some rank writes them; an "sp" column, each rank's sequence shard,
    only under sequence parallelism."""
    config = plan.config
    memory = "host" if plan.one_pool else "device"
    swapping = plan.nvme_total > 0
    nvme_header = f" {'nvme':>12}" if swapping else ""
    # A sequence-shard column only where sequences are split.
    sequenced = config.parallel.sequence_parallel_size > 1
    sp_header = f" {'sp':>3}" if sequenced else ""
    lines = [
        f"{config.model.label} on {config.world_size} rank(s): ZeRO-{config.zero_stage}, "
        f"{config.precision_label}, {config.trainer.backend} backend; optimizer states per rank: {plan.adam_share}",
        f"{'rank':>4} {'stage':>5} {'tp':>3} {'dp':>3}{sp_header} {'parameters':>12} {'gradients':>12} "
        f"{'optimizer':>12} {'offloaded':>12}{nvme_header} {'activations*':>13} {memory:>12} {'comm/step*':>12}",
    ]
    for rank in plan.ranks:
        states = rank.states
        held = plan.host_bytes(rank) if plan.one_pool else rank.device
        nvme = f" {format_bytes(states.nvme):>12}" if swapping else ""
        shard = f" {rank.where.sequence:>3}" if sequenced else ""
        lines.append(
            f"{rank.rank:>4} {rank.where.stage:>5} {rank.where.tensor:>3} {rank.where.data:>3}{shard} "
            f"{format_bytes(states.parameter):>12} {format_bytes(states.gradient):>12} "
            f"{format_bytes(states.optimizer):>12} {format_bytes(states.offloaded):>12}{nvme} "
            f"{format_bytes(rank.activations):>13} {format_bytes(held):>12} "
            f"{format_bytes(rank.communication.total):>12}"
        )
    other = "without" if plan.checkpointing else "with"
    checkpointing = (
        f"activation checkpointing {plan.checkpointing.label}" if plan.checkpointing else "no activation checkpointing"
    )
    if config.trainer.backend != "accelerate":
        rules = "DeepSpeed's partitioning and padding"
    elif config.zero_stage == 0:
        rules = "DDP holds every tensor whole"
    else:
        rules = "torch FSDP2's padded row pieces"
    lines.append(
        f"parameters, gradients and optimizer states are exact ({rules}); "
        f"* estimates: activations under {checkpointing} "
        f"({other} it: {format_bytes(max(r.activations_other for r in plan.ranks))} at most), "
        f"communication by ring collectives{' and all-to-alls' if sequenced else ''}; pipeline bubble "
        f"{plan.bubble:.1%}"
    )
    if plan.choices:
        lines.append(choices_line(plan))
    if plan.frozen:
        lines.append(adapters_line(plan))
    lines.append(data_line(plan))
    if swap_paths(config):
        lines.append(nvme_line(plan))
    if plan.one_pool:
        lines.append(
            "no accelerator here, so the device is the host: each rank's model states (offloaded or not), "
            f"activations and data are all host memory, {format_bytes(max(map(plan.host_bytes, plan.ranks)))} on "
            f"the busiest rank; {format_bytes(plan.host_total)} for {_node(plan)}, the data's shared pages once"
        )
    return "\n".join(lines)


def choices_line(plan: Plan) -> str:
    """The busiest rank's activations under each model.activation_checkpointing choice, least
    recompute first (models/activation_checkpointing.py)."""
    told = []
    for choice, device, host in plan.choices:
        offloaded = f" + {format_bytes(host)} in host memory" if host else ""
        told.append(f"{json.dumps(choice.value)} ({choice.label}) {format_bytes(device)}{offloaded}")
    return "activations by model.activation_checkpointing, least recompute first: " + "; ".join(told)


def adapters_line(plan: Plan) -> str:
    """model.lora: what trains, and the frozen base, which holds parameters alone."""
    config = plan.config
    lora = config.model.fields["lora"]
    targets = lora["target_modules"] if isinstance(lora["target_modules"], str) else ", ".join(lora["target_modules"])
    share = plan.trainable / (plan.trainable + plan.frozen)
    if config.trainer.backend == "accelerate":
        where = "in fp32, whole on every rank" if config.zero_stage == 0 else "in fp32, in FSDP2's pieces"
    else:
        held = "partitioned over the data-parallel ranks" if config.zero_stage == 3 else "whole on every rank"
        where = f"in {config.precision}, {held}"
    return (
        f"LoRA r {lora['r']} on {targets}: {plan.trainable:,} parameters train ({share:.2%}), with gradients and "
        f"optimizer states; the {plan.frozen:,} frozen base parameters are held {where}, without either"
    )


def data_line(plan: Plan) -> str:
    """The data's memory: what each rank holds for itself, and the page cache its node shares."""
    data = plan.data
    if data is None:
        return "data: not counted (the plan was not given the data's sizes)"
    parts = {
        "sample order": data.order,
        "blend index": data.blend,
        "workers' prefetched batches": data.workers,
        "data read into memory": data.loaded,
    }
    held = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items() if size)
    private = f"{format_bytes(data.private)} per rank ({held})" if held else "nothing per rank"
    shared = (
        f"{format_bytes(data.shared)} of files read through the page cache, which the ranks of a node share: "
        "counted once per node"
        if data.shared
        else "no files read through the page cache"
    )
    return f"data: {private}; {shared}"


def nvme_line(plan: Plan) -> str:
    """ZeRO-Infinity's NVMe offload: what the nvme column counts and what the swappers hold in host memory."""
    written = ", ".join(f"{format_bytes(size)} under {path}" for path, size in nvme_bytes(plan).items())
    buffers = max(rank.states.host_buffers for rank in plan.ranks)
    swap = zero_settings(plan.config, not plan.one_pool).swap
    return (
        f"nvme: the swap files each rank writes (the parameters, gradients and optimizer columns count only what "
        f"stays in memory); {_node(plan)} write {written}; only tensors of at least "
        f"{format_bytes(swap.min_aio_bytes)} are swapped; each rank page-locks up to {format_bytes(buffers)} of "
        "host memory for swap buffers"
    )


def verdict(plan: Plan, device_memory: int | None, host_memory: int | None) -> tuple[bool, str]:
    """Whether the busiest rank fits the device and the busiest node's host memory holds its ranks'
    offloaded states, NVMe swap buffers and data. Without an accelerator there is one memory, the host's, and a device
    budget would be a second one that does not exist: ValueError."""
    if plan.one_pool and device_memory is not None:
        raise ValueError(
            "this machine has no accelerator, so every rank holds everything in host memory: give the host's "
            "memory (--host-memory), not a device's"
        )
    if plan.one_pool:
        host = f"for {_node(plan)} (one pool: model states, activations and data)"
    else:
        buffers = ", NVMe swap buffers" if any(rank.states.host_buffers for rank in plan.ranks) else ""
        host = f"for {_node(plan)} (offloaded states{buffers}" + (" and data)" if plan.data else ")")
    budgets = [
        ("device", "on the busiest rank", plan.device_peak, device_memory),
        ("host", host, plan.host_total, host_memory),
    ]
    checked = [_budget(*budget) for budget in budgets if budget[3] is not None]
    return all(fits for fits, _ in checked), "\n".join(line for _, line in checked)


def _node(plan: Plan) -> str:
    ranks = min(plan.ranks_per_node, len(plan.ranks))
    return f"the {ranks} rank(s) of the busiest node" if ranks < len(plan.ranks) else f"the {ranks} rank(s) of one node"


def _budget(memory: str, holder: str, needed: int, available: int) -> tuple[bool, str]:
    margin = available - needed
    outcome = f"fits, {format_bytes(margin)} to spare" if margin >= 0 else f"does not fit, {format_bytes(-margin)} over"
    return margin >= 0, f"{memory}: {format_bytes(needed)} {holder} of {format_bytes(available)}: {outcome}"


def explain(plan: Plan) -> str:
    config = plan.config
    sequence = config.parallel.sequence_parallel_size
    if sequence > 1:
        layout_line = (
            f"{config.world_size} rank(s): {config.dp_size} data-parallel replica(s) x {sequence} sequence shard(s) "
            f"(Ulysses), ZeRO-{config.zero_stage} over all {config.dp_size * sequence}, {config.precision_label}"
        )
    else:
        layout_line = (
            f"{config.world_size} rank(s): {config.parallel.pipeline_parallel_size} pipeline stage(s) x "
            f"{config.dp_size} data-parallel replica(s) x {config.parallel.tensor_parallel_size} tensor shard(s), "
            f"ZeRO-{config.zero_stage}, {config.precision_label}"
        )
    lines = [layout_line]
    tensor, data = config.parallel.tensor_parallel_size, config.dp_size
    stages = config.parallel.pipeline_parallel_size
    for rank in plan.ranks:
        states, where = rank.states, rank.where
        if plan.one_pool:
            host = ", all of it in host memory (no accelerator)"
        else:
            host = f", {format_bytes(states.offloaded)} of it in host memory" if states.offloaded else ""
        if sequence > 1:
            place = f"data-parallel replica {where.data + 1} of {data}, {_sequence_shard(config, where.sequence)}"
            if config.zero_stage >= 1:
                # The shards of every replica hold the same weights, so ZeRO partitions over all of them.
                place += f"; ZeRO partition {where.data * sequence + where.sequence + 1} of {data * sequence}"
        else:
            place = (
                f"stage {where.stage + 1} of {stages} ({rank.layers}), TP shard {where.tensor + 1} of {tensor}, "
                f"data-parallel replica {where.data + 1} of {data}"
            )
        communication = rank.communication
        sends = {**communication.data_parallel}
        if communication.sequence_parallel:
            sends["all-to-alls around attention"] = communication.sequence_parallel
        lines.append(
            f"rank {rank.rank}: {place}, holds {plan.adam_share} of the optimizer "
            f"states: parameters {format_bytes(states.parameter)}, gradients {format_bytes(states.gradient)}, "
            f"optimizer {format_bytes(states.optimizer)}{host}{_nvme_clause(plan, rank.states)}; activations about "
            f"{format_bytes(rank.activations)}; sends about {format_bytes(communication.total)} per step"
            + "".join(f", {name} {format_bytes(size)}" for name, size in sends.items())
        )
    if plan.frozen:
        lines.append(adapters_line(plan))
    lines.append(data_line(plan))
    if swap_paths(config):
        lines.append(_nvme_rules(plan))
    return "\n".join(lines)


def _sequence_shard(config: EngineConfig, shard: int) -> str:
    """What sequence shard `shard` of a Ulysses group holds: its slice of every sequence outside
    attention, and inside it the whole sequence for its share of the heads (DeepSpeed's all-to-all
    hands rank r of the group the r-th block of heads, and repeats a key/value head over SP / kv
    ranks where there are fewer of them than ranks). Heads count from 0, as the model numbers them."""
    sequence, seq_len = config.parallel.sequence_parallel_size, config.data.seq_len
    family = get_family(config.model.family)
    architecture = family.architecture(config.model.fields)
    query, key_value = family.attention_heads
    heads, kv_heads = architecture[query], architecture[key_value]
    width = seq_len // sequence
    text = (
        f"sequence shard {shard + 1} of {sequence}: tokens {shard * width}-{(shard + 1) * width - 1} of every "
        f"{seq_len}-token sequence, and inside attention the whole sequence for "
        f"{_heads('query head', shard, heads // sequence)} of {heads}"
    )
    if key_value == query:
        return text
    if kv_heads >= sequence:
        return text + f" and {_heads('key/value head', shard, kv_heads // sequence)} of {kv_heads}"
    repeats = sequence // kv_heads
    return text + f" and key/value head {shard // repeats} of {kv_heads} (repeated over {repeats} ranks)"


def _heads(noun: str, block: int, count: int) -> str:
    """The `block`-th run of `count` heads: "query head 3" or "query heads 4-7"."""
    first = block * count
    return f"{noun} {first}" if count == 1 else f"{noun}s {first}-{first + count - 1}"


def _nvme_clause(plan: Plan, states: StateBytes) -> str:
    """What one rank swaps to NVMe, by state and folder, and the host memory its swappers lock."""
    paths = swap_paths(plan.config)
    if not paths:
        return ""
    swapped = [
        ("parameter partitions", states.nvme_parameter, paths.get("offload_param")),
        ("fp32 master weights and optimizer moments", states.nvme_optimizer, paths.get("offload_optimizer")),
        ("fp32 gradients", states.nvme_gradient, paths.get("offload_optimizer")),
    ]
    written = ", ".join(f"{name} {format_bytes(size)} under {path}" for name, size, path in swapped if size)
    on_nvme = f"writes to NVMe {written}" if written else "writes nothing to NVMe (no tensor is large enough)"
    memories = (("host", states.host_buffers), ("device", states.device_buffers))
    locked = " and ".join(f"{format_bytes(size)} of {memory} memory" for memory, size in memories if size)
    return f"; {on_nvme}" + (f", and holds {locked} in swap buffers" if locked else "")


def _nvme_rules(plan: Plan) -> str:
    """DeepSpeed's rules behind the NVMe figures, with this config's numbers."""
    zero = zero_settings(plan.config, not plan.one_pool)
    swap = zero.swap
    rules = [
        f"NVMe (ZeRO-Infinity): DeepSpeed swaps a tensor only from {format_bytes(swap.min_aio_bytes)} up "
        f"(max(1 MiB, aio.block_size)), smaller ones stay in memory, and pads each file to a multiple of "
        f"{format_bytes(swap.aligned_bytes)} (1 KiB per I/O thread)"
    ]
    if zero.nvme_param:
        rules.append(
            "it writes every swappable parameter partition at start-up and then reads back into host memory, for "
            f"good, each optimizer sub-group that fits offload_param.max_in_cpu ({swap.max_in_cpu} elements per "
            "rank): those files stay on the drive but are not read again"
        )
    if zero.nvme_optimizer:
        rules.append(
            "the optimizer swaps whole sub-groups (partitions packed in order until they reach sub_group_size, "
            f"{zero.sub_group_size} elements): the fp32 master and moments, and the aligned part of each gradient"
        )
    return "; ".join(rules)


@dataclass(frozen=True)
class Candidate:
    overrides: list[str]
    plan: Plan


def suggest(
    config: EngineConfig,
    load: Callable[[list[str]], EngineConfig],
    device_memory: int | None,
    host_memory: int | None,
    hardware: Hardware | None = None,
    data: DataSizes | None = None,
) -> list[Candidate]:
    """Every layout of the same world size and global batch that is a valid config and fits,
    cheapest communication per step first (then least device memory). `load` validates overrides;
    `hardware` and `data` are `plan_run`'s."""
    world = config.world_size
    divisors = [n for n in range(1, world + 1) if world % n == 0]
    micro = config.batch.micro_batch_size
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
                        # The least recompute that fits: recomputing more would only cost time.
                        for checkpointing in _checkpointing_overrides(config, pipeline):
                            overrides = [
                                f"zero_optimization.stage={stage}",
                                "zero_optimization.offload_optimizer.device=none",
                                "zero_optimization.offload_param.device=none",
                                *offload_sets,
                                f"parallel.tensor_parallel_size={tensor}",
                                f"parallel.pipeline_parallel_size={pipeline}",
                                f"train_micro_batch_size_per_gpu={size}",
                                f"train_batch_size={config.batch.train_batch_size}",
                                "gradient_accumulation_steps=auto",
                                *checkpointing,
                            ]
                            try:
                                plan = plan_run(load(overrides), hardware, data)
                            except (ConfigError, ValueError):
                                continue
                            fits, _ = verdict(plan, device_memory, host_memory)
                            if fits:
                                found.append(Candidate(overrides, plan))
                                break
    found.sort(key=lambda candidate: (candidate.plan.communication, candidate.plan.device_peak))
    return found


def _checkpointing_overrides(config: EngineConfig, pipeline: int) -> list[list[str]]:
    """The activation checkpointing `suggest` tries on a layout, least recompute first: pipeline
    stages recompute by layer interval, other layouts by model.activation_checkpointing's choices
    (`SUGGESTED`) where the family's estimate tells them apart."""
    if pipeline > 1:
        off = "model.activation_checkpointing=false"
        return [[off, f"parallel.pipeline_activation_checkpoint_interval={interval}"] for interval in (0, 1)]
    interval = "parallel.pipeline_activation_checkpoint_interval=0"
    if not get_family(config.model.family).suggests_checkpointing:
        return [[interval]]
    return [[interval, f"model.activation_checkpointing={json.dumps(choice.value)}"] for choice in SUGGESTED]


def describe_candidate(candidate: Candidate) -> str:
    config, plan = candidate.plan.config, candidate.plan
    zero = config.document["zero_optimization"]
    offload = [name for name in ("optimizer", "param") if zero[f"offload_{name}"]["device"] != "none"]
    checkpointing = plan.checkpointing.label
    host = f"host {format_bytes(plan.host_total)}"
    memory = f"{host} (one pool)" if plan.one_pool else f"device {format_bytes(plan.device_peak)}, {host}"
    return (
        f"ZeRO-{config.zero_stage}"
        + (f" offload {'+'.join(offload)}" if offload else "")
        + f", TP {config.parallel.tensor_parallel_size}, PP {config.parallel.pipeline_parallel_size}, "
        f"micro-batch {config.document['train_micro_batch_size_per_gpu']} x "
        f"{config.document['gradient_accumulation_steps']}, checkpointing {checkpointing}: {memory}, "
        f"comm {format_bytes(plan.communication)}/step\n    --set "
        + " --set ".join(map(shlex.quote, candidate.overrides))
    )
