"""The bytes of parameters, gradients and optimizer states one rank holds, from the element counts
of its parameters: DeepSpeed's own flattening, alignment and partitioning rules restated, so that
the prediction equals what `engine.observability.memory.rank_memory` counts on the live rank, byte for byte.

Each rule cites the DeepSpeed 0.19 code it restates (paths under deepspeed/runtime/), or torch's
FSDP2 for the accelerate backend (under torch/distributed/fsdp/_fully_shard/). Verified byte-exact
against measured runs for fp32 on CPU (ZeRO-0/1/2/3, optimizer and parameter offload, tensor and
pipeline parallelism, DDP and FSDP2 with and without offload); bf16/fp16 follow the same code
paths by reading, not measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

FP32_BYTES = 4
# torch.optim.Adam/AdamW keep `step` as a float32 scalar tensor per parameter; DeepSpeed's
# FusedAdam and DeepSpeedCPUAdam keep a Python int (ops/adam/fused_adam.py, cpu_adam.py).
TORCH_STEP_BYTES = 4
# zero/stage_1_and_2.py: `nccl_start_alignment_factor = 2`; flat groups are padded to a multiple
# of it times the data-parallel size. bf16_optimizer.py uses the same factor.
NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class OptimizerKind:
    """What the optimizer keeps per element: Adam two moments, SGD with momentum one, plain SGD
    none; and whether each state entry has torch's 4-byte step tensor."""

    moments: int
    torch_step: bool


@dataclass(frozen=True)
class StateBytes:
    parameter: int
    gradient: int
    optimizer: int
    offloaded: int  # the part of the three above held in host memory because of offload

    @property
    def total(self) -> int:
        return self.parameter + self.gradient + self.optimizer

    @property
    def on_device(self) -> int:
        return self.total - self.offloaded


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    precision: str  # fp32, bf16, fp16
    offload_optimizer: bool
    offload_param: bool
    persistence_threshold: int  # stage 3: parameters this small stay whole on every rank
    sub_group_size: int  # stage 3: elements per optimizer sub-group
    pipeline: bool  # DeepSpeed's pipeline engine, which wraps bf16 in BF16_Optimizer even at stage 0


def element_bytes(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else 2


def aligned(count: int, multiple: int) -> int:
    return math.ceil(count / multiple) * multiple


def state_bytes(
    groups: Sequence[Sequence[int]], zero: ZeroSettings, dp_size: int, dp_rank: int, optimizer: OptimizerKind
) -> StateBytes:
    """One rank's model states: `groups` are the element counts of its trainable parameters (this
    stage's, this tensor shard's) per optimizer group, each once, in the order of the groups, which
    is the order ZeRO flattens. Every ZeRO optimizer flattens, pads and partitions each group on
    its own, so a rank's bytes are the sum of its groups'."""
    parts = [_group_bytes(numels, zero, dp_size, dp_rank, optimizer) for numels in groups]
    return StateBytes(*(sum(getattr(part, field.name) for part in parts) for field in fields(StateBytes)))


def _group_bytes(
    numels: Sequence[int], zero: ZeroSettings, dp_size: int, dp_rank: int, optimizer: OptimizerKind
) -> StateBytes:
    if zero.stage == 0:
        return _zero0(numels, zero, dp_size, optimizer)
    if zero.stage in (1, 2):
        return _zero12(numels, zero, dp_size, dp_rank, optimizer)
    return _zero3(numels, zero, dp_size, optimizer)


def _moment_bytes(elements: int, groups: int, optimizer: OptimizerKind, torch_optimizer: bool) -> int:
    step = TORCH_STEP_BYTES * groups if optimizer.torch_step and torch_optimizer and optimizer.moments else 0
    return FP32_BYTES * optimizer.moments * elements + step


def _zero0(numels: Sequence[int], zero: ZeroSettings, dp_size: int, optimizer: OptimizerKind) -> StateBytes:
    total = sum(numels)
    if zero.precision == "fp32":
        # engine.py `_configure_optimizer`: fp32 without ZeRO steps the bare torch optimizer on the
        # model's own tensors: one gradient per parameter, moments (and step) per parameter.
        return StateBytes(FP32_BYTES * total, FP32_BYTES * total, _moment_bytes(total, len(numels), optimizer, True), 0)
    if zero.precision == "bf16" and zero.pipeline:
        # engine.py `_do_optimizer_sanity_check` picks BF16_Optimizer under the pipeline engine;
        # bf16_optimizer.py: one bf16 flat buffer aligned to 2 x dp, an fp32 gradient buffer of the
        # same length (the lp gradients are dropped as they are accumulated), and an fp32 master
        # partition of flat/dp elements that the optimizer steps.
        flat = aligned(total, NCCL_START_ALIGNMENT_FACTOR * dp_size)
        partition = flat // dp_size
        optimizer_bytes = FP32_BYTES * partition + _moment_bytes(partition, 1, optimizer, True)
        return StateBytes(2 * flat, FP32_BYTES * flat, optimizer_bytes, 0)
    # fp16, and bf16 outside the pipeline (`DDP_BFLOAT16`), go to `_configure_fp16_optimizer`:
    # half-precision weights and `.grad`s until the step, whole fp32 masters the optimizer steps:
    # one flat tensor per group under FusedAdam (fp16/fp16_optimizer.py, no step tensor), one per
    # parameter otherwise (fp16/unfused_optimizer.py, where torch's Adam keeps a step per parameter).
    optimizer_bytes = FP32_BYTES * total + _moment_bytes(total, len(numels), optimizer, True)
    return StateBytes(2 * total, 2 * total, optimizer_bytes, 0)


def _zero12(
    numels: Sequence[int], zero: ZeroSettings, dp_size: int, dp_rank: int, optimizer: OptimizerKind
) -> StateBytes:
    size = element_bytes(zero.precision)
    # zero/stage_1_and_2.py `__init__`: the group is flattened and padded to a multiple of
    # 2 x dp (`flatten_dense_tensors_aligned`), then cut into dp equal partitions.
    flat = aligned(sum(numels), NCCL_START_ALIGNMENT_FACTOR * dp_size)
    partition = flat // dp_size
    parameters = size * flat
    # The master partition is a clone of this rank's slice, in fp32 even when training in fp32.
    masters = FP32_BYTES * partition
    if zero.offload_optimizer:
        # `initialize_optimizer_states`: under cpu_offload the gradient is a pinned fp32 host tensor
        # of one partition, `single_partition_of_fp32_groups[i].grad`; DeepSpeedCPUAdam steps it.
        gradients = FP32_BYTES * partition
        optimizer_bytes = masters + _moment_bytes(partition, 1, optimizer, torch_optimizer=False)
        return StateBytes(parameters, gradients, optimizer_bytes, gradients + optimizer_bytes)
    # `copy_grads_in_partition`: `grads_in_partition` holds the whole gradient of every parameter
    # that overlaps this rank's partition (`params_in_partition`, from `get_partition_info`), so a
    # parameter straddling two partitions has its full gradient on both ranks.
    # `get_flat_partition` appends a zero tensor for the alignment padding that falls in this
    # partition (`groups_padding`), so the last rank also holds the padding as gradient.
    start, end = dp_rank * partition, (dp_rank + 1) * partition
    held, offset = 0, 0
    for numel in numels:
        if offset < end and offset + numel > start:
            held += numel
        offset += numel
    held += max(0, min(partition, end - offset))
    optimizer_bytes = masters + _moment_bytes(partition, 1, optimizer, torch_optimizer=True)
    return StateBytes(parameters, size * held, optimizer_bytes, 0)


def _zero3(numels: Sequence[int], zero: ZeroSettings, dp_size: int, optimizer: OptimizerKind) -> StateBytes:
    size = element_bytes(zero.precision)
    # zero/partition_parameters.py `_partition_param`: each parameter is padded to a multiple of
    # dp (`_padding_size`) and every rank keeps numel/dp of it as `ds_tensor`; stage3.py
    # defragments those into one flat buffer (`lp_param_buffer`).
    partition = sum(math.ceil(numel / dp_size) for numel in numels)
    # zero/parameter_offload.py `mark_persistent_parameters`: a parameter of at most
    # stage3_param_persistence_threshold elements stays gathered on every rank after the step.
    persistent = sum(numel for numel in numels if numel <= zero.persistence_threshold)
    partitions = size * partition
    parameters = partitions + size * persistent
    # stage3.py: gradients are reduce-scattered into `grad_partitions_flat_buffer` (one partition);
    # with the optimizer offloaded they are also copied to the fp32 host gradient of the master.
    gradients = size * partition
    host_gradients = FP32_BYTES * partition if zero.offload_optimizer else 0
    groups = max(1, math.ceil(partition / zero.sub_group_size))  # `_create_fp16_sub_groups`
    optimizer_bytes = FP32_BYTES * partition + _moment_bytes(
        partition, groups, optimizer, torch_optimizer=not zero.offload_optimizer
    )
    offloaded = (partitions if zero.offload_param else 0) + (
        host_gradients + optimizer_bytes if zero.offload_optimizer else 0
    )
    return StateBytes(parameters, gradients + host_gradients, optimizer_bytes, offloaded)


def accelerate_state_bytes(
    shapes: Sequence[Sequence[int]], wrapper: str, world_size: int, rank: int, optimizer: OptimizerKind, offload: bool
) -> StateBytes:
    """One rank's model states under the accelerate backend, from the shapes of the model's trainable
    parameters. DDP holds everything whole. FSDP2 (torch's `fully_shard`) cuts each parameter on
    dimension 0 into `torch.chunk`'s pieces of ceil(rows / N) rows, so the last ranks may hold fewer
    rows or none, and a rank's bytes depend on its rank:

    - parameters (_fsdp_param.py `_init_sharded_param`): every rank allocates the padded piece,
      `new_zeros(chunks[0].size())`, and its own rows are a view into it;
    - gradients (_fsdp_collectives.py `foreach_reduce`): each is an `as_strided` view into one
      reduce-scatter output of padded pieces per sharded module, so padded too. With offload on a
      GPU each is then copied to the host unpadded (`.to("cpu")`, the same tensor on a CPU rank),
      so there the plan's gradients are over by up to one piece's padding per parameter;
    - optimizer: torch's Adam allocates its moments like the rank's own rows (unpadded), and one
      step tensor per parameter.

    Either offload key offloads all three (`CPUOffloadPolicy`: the optimizer steps on the host)."""
    if wrapper == "ddp":
        total = sum(math.prod(shape) for shape in shapes)
        return StateBytes(FP32_BYTES * total, FP32_BYTES * total, _moment_bytes(total, len(shapes), optimizer, True), 0)
    padded = held = 0
    for rows, *rest in shapes:
        piece = math.ceil(rows / world_size)
        padded += piece * math.prod(rest)
        held += max(0, min(piece, rows - rank * piece)) * math.prod(rest)
    parameter = gradient = FP32_BYTES * padded
    optimizer_bytes = _moment_bytes(held, len(shapes), optimizer, True)
    offloaded = parameter + gradient + optimizer_bytes if offload else 0
    return StateBytes(parameter, gradient, optimizer_bytes, offloaded)
