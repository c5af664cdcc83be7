"""The plan of a config at a world size: per rank, the exact model-state bytes (`states.py`), the
estimated activations and communication (`estimate.py`) and the data's memory (`data.py`), then a
verdict against the memory a device and a host have. Everything runs on the meta device: no model
memory is allocated."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.config.schema import AUTO
from engine.launch.hardware import Hardware, detect_hardware
from engine.parallel.layout import Coordinates, ParallelLayout, parallel_layout
from engine.plan.data import DataMemory, DataSizes, data_memory
from engine.plan.estimate import (
    Communication,
    data_parallel_bytes,
    pipeline_bubble,
    pipeline_bytes,
    sequence_parallel_bytes,
    tensor_parallel_bytes,
)
from engine.plan.shapes import stage_numels, unique_parameters
from engine.plan.states import (
    AIO_ALIGNED_BYTES,
    MIN_AIO_BYTES,
    OptimizerKind,
    StateBytes,
    SwapSettings,
    ZeroSettings,
    accelerate_state_bytes,
    state_bytes,
)
from models import get_family
from models.activation_checkpointing import EVERY_BLOCK, NONE, SUGGESTED, Checkpointing
from models.costs import PlanShape

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'80GiB', '512 GB', '1.5TiB' or a plain byte count; ValueError naming the text otherwise."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 80GiB, 512GB or 1.5TiB")
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class RankPlan:
    rank: int
    where: Coordinates
    layers: str
    states: StateBytes
    activations: int  # estimate, on the device, at the configured activation checkpointing
    activations_other: int  # estimate with checkpointing switched the other way (off, or every block)
    communication: Communication
    activations_offloaded: int = 0  # estimate, in host memory: what an offloading choice moves there

    @property
    def device(self) -> int:
        return self.states.on_device + self.activations


@dataclass(frozen=True)
class Plan:
    config: EngineConfig
    ranks: list[RankPlan]
    bubble: float
    checkpointing: Checkpointing
    adam_share: str  # "1/8": the fraction of the optimizer states each rank holds
    data: DataMemory | None  # None: the plan was not given the data's sizes
    one_pool: bool  # no accelerator: the device is the host, and every byte a rank holds is host memory
    ranks_per_node: int
    trainable: int = 0  # parameters that train, each tensor once (the whole model's, unsplit)
    frozen: int = 0  # parameters that do not (model.lora's base)
    # Each choice `plan --suggest` tries, with the busiest rank's activations on the device and in
    # host memory under it; empty under pipeline parallelism (an interval of pipeline layers decides)
    # and for a family whose checkpointing is not suggested.
    choices: tuple[tuple[Checkpointing, int, int], ...] = ()

    @property
    def device_peak(self) -> int:
        return max(rank.device for rank in self.ranks)

    def host_bytes(self, rank: RankPlan) -> int:
        """What one rank holds in host memory on its own: its offloaded states, its NVMe swap
        buffers and its private data, and where the device is the host, everything else as well
        (offload then moves states within one memory, and ZeRO-3's offloaded gradients are a second
        copy in it). What lives on NVMe is in none of them."""
        states = rank.states
        held = states.total + rank.activations if self.one_pool else states.offloaded
        held += rank.activations_offloaded
        return held + states.host_buffers + (self.data.private if self.data else 0)

    @property
    def nodes(self) -> list[list[RankPlan]]:
        size = self.ranks_per_node
        return [self.ranks[start : start + size] for start in range(0, len(self.ranks), size)]

    @property
    def host_total(self) -> int:
        """The host memory of the busiest node: its ranks' own bytes, and the data's shared pages once."""
        shared = self.data.shared if self.data else 0
        return shared + max(sum(self.host_bytes(rank) for rank in node) for node in self.nodes)

    @property
    def nvme_total(self) -> int:
        """The swap files the busiest node's ranks write, over all their nvme_paths."""
        return max(sum(rank.states.nvme for rank in node) for node in self.nodes)

    @property
    def communication(self) -> int:
        return max(rank.communication.total for rank in self.ranks)


def optimizer_kind(config: EngineConfig) -> OptimizerKind:
    """Adam and AdamW keep two fp32 moments, SGD one momentum buffer when momentum is set.
    torch's own Adam (resolved `torch_adam`) adds its step tensor; DeepSpeed's Adams do not."""
    section = config.document["optimizer"]
    params = section["params"]
    if section["type"] == "SGD":
        return OptimizerKind(moments=1 if params.get("momentum", 0) else 0, torch_step=False)
    torch_adam = bool(params.get("torch_adam", False)) or config.trainer.backend == "accelerate"
    return OptimizerKind(moments=2, torch_step=torch_adam)


def zero_settings(config: EngineConfig, accelerator: bool) -> ZeroSettings:
    """What the state rules read of the config; `accelerator`: the ranks have a device besides the host."""
    zero = config.document["zero_optimization"]
    param, optimizer = zero["offload_param"], zero["offload_optimizer"]
    swapped = swap_paths(config)
    aio = config.document.get("aio", {})
    return ZeroSettings(
        stage=config.zero_stage,
        precision=config.precision,
        offload_optimizer=optimizer["device"] != "none",
        offload_param=param["device"] != "none",
        persistence_threshold=zero["stage3_param_persistence_threshold"],
        sub_group_size=zero["sub_group_size"],
        pipeline=parallel_layout(config).pipeline > 1,
        nvme_param="offload_param" in swapped,
        nvme_optimizer="offload_optimizer" in swapped,
        # Derived as the swappers derive them (swap_tensor/partitioned_param_swapper.py
        # `_configure_aio`, optimizer_utils.py `OptimizerSwapper`), with the defaults of
        # zero/offload_config.py and swap_tensor/constants.py.
        swap=SwapSettings(
            min_aio_bytes=max(MIN_AIO_BYTES, aio.get("block_size", 1048576)),
            aligned_bytes=AIO_ALIGNED_BYTES * aio.get("intra_op_parallelism", 1),
            gds=bool(aio.get("use_gds", False)),
            param_buffer_count=param.get("buffer_count", 5),
            param_buffer_size=int(param.get("buffer_size", 10**8)),
            max_in_cpu=int(param.get("max_in_cpu", 10**9)),
            optimizer_buffer_count=optimizer.get("buffer_count", 4),
        ),
        accelerator=accelerator,
    )


def swap_paths(config: EngineConfig) -> dict[str, str]:
    """The offload sections that swap to NVMe ("offload_param", "offload_optimizer"), each with its
    nvme_path as the config writes it. DeepSpeed swaps under ZeRO-3 only: stages 1 and 2 take
    "nvme" as host memory (zero/stage_1_and_2.py reads only whether the device is "none")."""
    if config.zero_stage != 3:
        return {}
    zero = config.document["zero_optimization"]
    sections = ("offload_param", "offload_optimizer")
    return {section: zero[section]["nvme_path"] for section in sections if zero[section]["device"] == "nvme"}


def nvme_bytes(plan: Plan) -> dict[str, int]:
    """Each nvme_path of the plan's config, as written there, with the bytes of the swap files that
    the node writing most there writes (the parameters' and the optimizer's folders may be one):
    what its drive must have free before launch."""
    paths = swap_paths(plan.config)

    def written(rank: RankPlan, path: str) -> int:
        states = rank.states
        parameters = states.nvme_parameter if paths.get("offload_param") == path else 0
        optimizer = states.nvme_optimizer + states.nvme_gradient if paths.get("offload_optimizer") == path else 0
        return parameters + optimizer

    return {path: max(sum(written(rank, path) for rank in node) for node in plan.nodes) for path in paths.values()}


def plan_run(config: EngineConfig, hardware: Hardware | None = None, data: DataSizes | None = None) -> Plan:
    """The plan of a loaded config, its vocabulary settled from the data as a launch settles it
    (`engine.preflight.check_data`), at its world size, on `hardware` (by default this machine, with
    every rank on it: the hardware `load_config` resolved the config against), with the data's
    memory when `data` gives its sizes (`engine.plan.data.data_sizes`)."""
    if hardware is None:
        hardware = detect_hardware(local_world_size=config.world_size)
    family = get_family(config.model.family)
    if family.uses_vocabulary and config.model.fields.get("vocab_size", AUTO) == AUTO:
        raise ValueError(
            'plan_run plans a config whose model.vocab_size "auto" is settled from the data, as a launch settles '
            "it: pass the config engine.preflight.check_data returns"
        )
    layout = parallel_layout(config)
    numels, parts, model = stage_numels(config, family)
    # The accelerate backend has no pipeline or tensor parallelism: each rank holds the whole model's shapes.
    shapes = [tuple(p.shape) for p in unique_parameters([model]) if p.requires_grad]
    # model.lora's frozen base, which combines with neither (engine/config/rules.py): every rank's.
    frozen = [tuple(p.shape) for p in unique_parameters([model]) if not p.requires_grad]
    zero, optimizer = zero_settings(config, hardware.device_type != "cpu"), optimizer_kind(config)
    micro, accumulation = config.batch.micro_batch_size, config.batch.gradient_accumulation_steps
    element = 4 if config.compute_precision == "fp32" else 2
    checkpointing = config.model.activation_checkpointing
    if layout.pipeline > 1:
        checkpointing = EVERY_BLOCK if config.parallel.pipeline_activation_checkpoint_interval > 0 else NONE
    blocks = family.pipeline.num_blocks(family.architecture(config.model.fields))
    estimate = family.plan_activations(
        PlanShape(
            config.model.fields,
            config.data.as_mapping(),
            model,
            tuple(parts),
            layout.pipeline,
            layout.tensor,
            micro,
            element,
            layout.sequence,
            # ZeRO-3 and FSDP hold a shard of the head outside its forward; tensor parallelism a vocabulary slice.
            whole_head=layout.tensor == 1
            and (
                config.accelerate_wrapper == "ddp" if config.trainer.backend == "accelerate" else config.zero_stage < 3
            ),
        )
    )

    def activations(where: Coordinates, choice: Checkpointing) -> tuple[int, int]:
        """One rank's activations under `choice`: on the device, and offloaded to host memory."""
        # 1F1B: stage s keeps up to p - s micro-batches' activations in flight.
        in_flight = min(layout.pipeline - where.stage, accumulation)
        stage_blocks = _stage_blocks(blocks, layout.pipeline, where.stage)
        device = estimate.stage_bytes(where.stage, stage_blocks, choice)
        kept = estimate.stage_bytes(where.stage, stage_blocks, replace(choice, offload=False))
        return in_flight * device, in_flight * (kept - device)

    ranks = []
    for rank in range(layout.world_size):
        where = layout.coordinates(rank)
        groups = numels[where.stage]
        stage = [numel for group in groups for numel in group]
        if config.trainer.backend == "accelerate":
            offload = zero.offload_optimizer or zero.offload_param
            states = accelerate_state_bytes(
                shapes, config.accelerate_wrapper, layout.world_size, where.data, optimizer, offload, frozen
            )
        else:
            # ZeRO partitions over every rank holding the weights: each replica's sequence shards, in rank order.
            zero_rank = where.data * layout.sequence + where.sequence
            frozen_numels = [math.prod(s) for s in frozen]
            states = state_bytes(groups, zero, layout.zero_ranks, zero_rank, optimizer, frozen_numels)
        stage_blocks = _stage_blocks(blocks, layout.pipeline, where.stage)
        device, offloaded = activations(where, checkpointing)
        communication = Communication(
            data_parallel_bytes(zero.stage, sum(stage), element, layout.zero_ranks, sum(map(math.prod, frozen))),
            tensor_parallel_bytes(stage_blocks, estimate.hidden, estimate.tokens, element, layout.tensor, accumulation),
            pipeline_bytes(estimate.boundaries, element, where.stage, accumulation),
            sequence_parallel_bytes(
                stage_blocks, estimate.attention_width, estimate.tokens, element, layout.sequence, accumulation
            ),
        )
        ranks.append(
            RankPlan(
                rank,
                where,
                f"layers {parts[where.stage]}-{parts[where.stage + 1] - 1}",
                states,
                device,
                activations(where, NONE if checkpointing else EVERY_BLOCK)[0],
                communication,
                offloaded,
            )
        )
    share = layout.zero_ranks if zero.stage >= 1 else 1
    adam_share = (
        f"1/{share * layout.tensor * layout.pipeline}" if share * layout.tensor * layout.pipeline > 1 else "all"
    )
    memory = data_memory(data, micro, config.data.num_workers) if data is not None else None
    return Plan(
        config,
        ranks,
        pipeline_bubble(layout.pipeline, accumulation),
        checkpointing,
        adam_share,
        memory,
        hardware.device_type == "cpu",
        hardware.local_world_size,
        sum(math.prod(shape) for shape in shapes),
        sum(math.prod(shape) for shape in frozen),
        _choices(activations, layout, family.suggests_checkpointing),
    )


def _choices(
    activations: Callable[[Coordinates, Checkpointing], tuple[int, int]], layout: ParallelLayout, suggested: bool
) -> tuple[tuple[Checkpointing, int, int], ...]:
    """Each suggested checkpointing choice with the busiest rank's device and host activations."""
    if layout.pipeline > 1 or not suggested:
        return ()
    coordinates = [layout.coordinates(rank) for rank in range(layout.world_size)]
    return tuple(
        (
            choice,
            max(activations(where, choice)[0] for where in coordinates),
            max(activations(where, choice)[1] for where in coordinates),
        )
        for choice in SUGGESTED
    )


def _stage_blocks(blocks: int, stages: int, stage: int) -> int:
    """Blocks on a stage when they are spread evenly (the "type" partition; an estimate otherwise)."""
    return blocks // stages + (1 if stage < blocks % stages else 0)
