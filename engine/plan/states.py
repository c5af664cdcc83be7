"""The bytes of parameters, gradients and optimizer states one rank holds, from the element counts
of its parameters: DeepSpeed's own flattening, alignment and partitioning rules restated, so that
the prediction equals what `engine.observability.memory.rank_memory` counts on the live rank, byte for byte.

Each rule cites the DeepSpeed 0.19 code it restates (paths under deepspeed/runtime/), or torch's
FSDP2 for the accelerate backend (under torch/distributed/fsdp/_fully_shard/). Verified byte-exact
against measured runs for fp32 on CPU (ZeRO-0/1/2/3, optimizer and parameter offload, tensor and
pipeline parallelism, DDP and FSDP2 with and without offload); bf16/fp16 follow the same code
paths by reading, not measurement, and so does ZeRO-Infinity's NVMe offload (DeepSpeed 0.19.8).
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
# swap_tensor/utils.py: DeepSpeed swaps no tensor under MIN_AIO_BYTES (nor under aio.block_size),
# and pads every swap file to AIO_ALIGNED_BYTES per I/O thread.
MIN_AIO_BYTES = 2**20
AIO_ALIGNED_BYTES = 1024
# swap_tensor/partitioned_param_swapper.py `remove_partition_and_release_buffers`: a partition that
# lives on NVMe points at the swapper's one `invalid_buffer`, torch.tensor(1).half().
INVALID_BUFFER_BYTES = 2


@dataclass(frozen=True)
class OptimizerKind:
    """What the optimizer keeps per element: Adam two moments, SGD with momentum one, plain SGD
    none; and whether each state entry has torch's 4-byte step tensor."""

    moments: int
    torch_step: bool


@dataclass(frozen=True)
class StateBytes:
    """A rank's model states in memory, and under ZeRO-Infinity what it swaps to NVMe. Parameters,
    gradients and optimizer states count only the bytes held in memory, as the live rank measures
    them: what lives on NVMe is in the swap-file fields instead, and the swappers' staging buffers,
    which hold no state of their own between uses, are neither."""

    parameter: int
    gradient: int
    optimizer: int
    offloaded: int  # the part of the three above held in host memory because of offload
    # Bytes of the swap files this rank writes, padded as DeepSpeed writes them:
    nvme_parameter: int = 0  # under offload_param.nvme_path
    nvme_gradient: int = 0  # fp32 gradients, under offload_optimizer.nvme_path
    nvme_optimizer: int = 0  # fp32 master weights and moments, under offload_optimizer.nvme_path
    host_buffers: int = 0  # the swappers' page-locked host buffers
    device_buffers: int = 0  # the parameter swapper's buffers under aio.use_gds (GPUDirect Storage)

    @property
    def total(self) -> int:
        return self.parameter + self.gradient + self.optimizer

    @property
    def on_device(self) -> int:
        return self.total - self.offloaded + self.device_buffers

    @property
    def nvme(self) -> int:
        return self.nvme_parameter + self.nvme_gradient + self.nvme_optimizer


@dataclass(frozen=True)
class SwapSettings:
    """What ZeRO-Infinity's swappers read of the config (zero/offload_config.py for the defaults,
    swap_tensor/aio_config.py), as they derive it."""

    min_aio_bytes: int  # max(MIN_AIO_BYTES, aio.block_size): no smaller tensor is swapped
    aligned_bytes: int  # AIO_ALIGNED_BYTES x aio.intra_op_parallelism: swap files are padded to it
    gds: bool  # aio.use_gds: the parameter swapper's buffers are device memory
    param_buffer_count: int
    param_buffer_size: int  # elements per parameter swap buffer
    max_in_cpu: int  # partition elements DeepSpeed reads back from NVMe into host memory for good
    optimizer_buffer_count: int

    def aligned(self, numel: int, element: int) -> int:
        """`_io_aligned_numel`: the elements a swap file or buffer of `numel` elements takes."""
        return aligned(numel, self.aligned_bytes // element)


@dataclass(frozen=True)
class ZeroSettings:
    stage: int
    precision: str  # fp32, bf16, fp16
    offload_optimizer: bool
    offload_param: bool
    persistence_threshold: int  # stage 3: parameters this small stay whole on every rank
    sub_group_size: int  # stage 3: elements per optimizer sub-group
    pipeline: bool  # DeepSpeed's pipeline engine, which wraps bf16 in BF16_Optimizer even at stage 0
    nvme_param: bool  # stage 3 with offload_param.device "nvme" (DeepSpeed swaps at no other stage)
    nvme_optimizer: bool  # stage 3 with offload_optimizer.device "nvme"
    swap: SwapSettings
    accelerator: bool  # the ranks have a device beside the host, so DeepSpeed's copies to it are copies


def element_bytes(precision: str) -> int:
    return FP32_BYTES if precision == "fp32" else 2


def aligned(count: int, multiple: int) -> int:
    return math.ceil(count / multiple) * multiple


def state_bytes(
    groups: Sequence[Sequence[int]],
    zero: ZeroSettings,
    dp_size: int,
    dp_rank: int,
    optimizer: OptimizerKind,
    frozen: Sequence[int] = (),
) -> StateBytes:
    """One rank's model states: `groups` are the element counts of its trainable parameters (this
    stage's, this tensor shard's) per optimizer group, each once, in the order of the groups, which
    is the order ZeRO flattens. Every ZeRO optimizer flattens, pads and partitions each group on
    its own, so a rank's bytes are the sum of its groups'; ZeRO-3 too, except that its NVMe swap
    buffers and `max_in_cpu` span all the groups. `frozen`: the element counts of the parameters that
    do not train (model.lora's base), which hold parameter bytes alone (`_frozen_bytes`)."""
    if zero.stage == 3:
        trained = _zero3(groups, zero, dp_size, optimizer)
    else:
        trained = _added([_group_bytes(numels, zero, dp_size, dp_rank, optimizer) for numels in groups])
    return _added([trained, _frozen_bytes(frozen, zero, dp_size)])


def _frozen_bytes(numels: Sequence[int], zero: ZeroSettings, dp_size: int) -> StateBytes:
    """Parameters no optimizer holds: no gradient, no master, no moments. engine.py
    `_configure_distributed_model` casts the whole module to bf16/fp16, so they are held in the training
    dtype; below ZeRO-3 whole on every rank. Under ZeRO-3, partition_parameters.py partitions every
    parameter as `_zero3_parameters` counts it (a piece of numel/dp, the whole of a persistent one), but
    stage3.py's flat buffers take the optimizer's groups only, so each frozen piece stays where
    `zero.Init` put it: on the host under parameter offload (NVMe-swapped pieces counted as host memory)."""
    size = element_bytes(zero.precision)
    if zero.stage < 3:
        return StateBytes(size * sum(numels), 0, 0, 0)
    persistent = size * sum(numel for numel in numels if numel <= zero.persistence_threshold)
    partition = size * sum(math.ceil(numel / dp_size) for numel in numels)
    return StateBytes(partition + persistent, 0, 0, partition if zero.offload_param else 0)


def _added(parts: Sequence[StateBytes]) -> StateBytes:
    return StateBytes(*(sum(getattr(part, field.name) for part in parts) for field in fields(StateBytes)))


def _group_bytes(
    numels: Sequence[int], zero: ZeroSettings, dp_size: int, dp_rank: int, optimizer: OptimizerKind
) -> StateBytes:
    if zero.stage == 0:
        return _zero0(numels, zero, dp_size, optimizer)
    return _zero12(numels, zero, dp_size, dp_rank, optimizer)


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


# A ZeRO-3 parameter as a rank holds it: its element count, and that of its partition.
Piece = tuple[int, int]


def _zero3(groups: Sequence[Sequence[int]], zero: ZeroSettings, dp_size: int, optimizer: OptimizerKind) -> StateBytes:
    # zero/partition_parameters.py `_partition_param`: each parameter is padded to a multiple of
    # dp (`_padding_size`) and every rank keeps numel/dp of it as `ds_tensor`.
    pieces = [[(numel, math.ceil(numel / dp_size)) for numel in numels] for numels in groups]
    sub_groups = [_sub_groups(group, zero.sub_group_size) for group in pieces]
    partition = sum(piece for group in pieces for _, piece in group)
    # stage3.py `_setup_for_real_optimizer`: gradients are reduce-scattered into
    # `grad_partitions_flat_buffer`, one partition.
    parts = [StateBytes(0, element_bytes(zero.precision) * partition, 0, 0), _zero3_parameters(sub_groups, zero)]
    parts += [_zero3_sub_group(sub, zero, optimizer) for subs in sub_groups for sub in subs]
    if zero.nvme_optimizer:
        # `_configure_tensor_swapping`, swap_tensor/optimizer_utils.py `OptimizerSwapper`: a
        # `SwapBufferManager` of buffer_count page-locked fp32 buffers, each as long as the
        # largest sub-group, swappable or not.
        largest = max(_elements(sub) for subs in sub_groups for sub in subs)
        buffers = zero.swap.optimizer_buffer_count * FP32_BYTES * zero.swap.aligned(largest, FP32_BYTES)
        parts.append(StateBytes(0, 0, 0, 0, host_buffers=buffers))
    return _added(parts)


def _elements(sub: Sequence[Piece]) -> int:
    return sum(piece for _, piece in sub)


def _sub_groups(group: Sequence[Piece], sub_group_size: int) -> list[list[Piece]]:
    """stage3.py `_create_fp16_sub_groups`: a group within sub_group_size partition elements is one
    sub-group; otherwise parameters join the open sub-group in order, and it closes once it
    reaches sub_group_size elements, or at the group's last parameter."""
    if sub_group_size >= _elements(group):
        return [list(group)]
    subs: list[list[Piece]] = [[]]
    for index, piece in enumerate(group):
        subs[-1].append(piece)
        if _elements(subs[-1]) >= sub_group_size and index < len(group) - 1:
            subs.append([])
    return subs


def _zero3_parameters(sub_groups: Sequence[Sequence[Sequence[Piece]]], zero: ZeroSettings) -> StateBytes:
    size = element_bytes(zero.precision)
    pieces = [piece for subs in sub_groups for sub in subs for piece in sub]
    # zero/parameter_offload.py `mark_persistent_parameters`: a parameter of at most
    # stage3_param_persistence_threshold elements stays gathered on every rank after the step.
    persistent = size * sum(numel for numel, _ in pieces if numel <= zero.persistence_threshold)
    partition = size * sum(piece for _, piece in pieces)
    if not zero.offload_param:
        # stage3.py `_create_fp16_partitions_with_defragmentation`: the partitions are defragmented
        # into one flat device buffer (`lp_param_buffer`).
        return StateBytes(partition + persistent, 0, 0, 0)
    if not zero.nvme_param:
        # `_create_param_groups_fp16_flat_cpu_memory`: one pinned host buffer per group.
        return StateBytes(partition + persistent, 0, 0, partition)
    swap = zero.swap

    def swappable(piece: int) -> bool:
        return piece * size >= swap.min_aio_bytes  # partitioned_param_swapper.py `swappable_tensor`

    # partition_parameters.py `_partition_param`: at start-up every swappable partition is written
    # to NVMe (persistence is marked only afterwards), every other one to pinned host memory.
    files = sum(size * swap.aligned(piece, size) for _, piece in pieces if swappable(piece))
    # stage3.py `_create_param_groups_fp16_flat_cpu_memory`: each group gets a pinned host buffer of
    # its elements, up to max_in_cpu elements over the groups so far (an empty one stands as
    # `torch.empty(1)`, a buffer no parameter points into, which a rank's measurement does not see).
    # `_create_fp16_partitions_with_defragmentation`: a sub-group that fits the
    # buffer's rest is read back into it for good (`_move_to_flat_buffer`; its swap files stay on
    # the drive, unread); the others keep their partitions where `_partition_param` put them.
    held, counted, spilled = 0, 0, []
    for subs in sub_groups:
        elements = sum(map(_elements, subs))
        capacity = elements if counted + elements <= swap.max_in_cpu else max(0, swap.max_in_cpu - counted)
        counted += elements
        held += capacity
        offset = 0
        for sub in subs:
            if offset + _elements(sub) > capacity:
                spilled += [piece for _, piece in sub]
            offset += _elements(sub)
    held += sum(piece for piece in spilled if not swappable(piece))
    on_nvme = any(swappable(piece) for piece in spilled)
    host = size * held + (INVALID_BUFFER_BYTES if on_nvme else 0)
    # partitioned_param_swapper.py `_configure_aio`: buffer_count buffers of buffer_size elements,
    # page-locked on the host, or on the device under GPUDirect Storage.
    buffers = swap.param_buffer_count * size * swap.aligned(swap.param_buffer_size, size)
    staging = 0
    if spilled:
        # `reserve_partitioned_swap_space`: a page-locked buffer that updated partitions are written
        # back through, sized on the largest sub-group (the first, on a tie) by the whole
        # `ds_numel` of each of its parameters, not by their partitions.
        largest = max((sub for subs in sub_groups for sub in subs), key=_elements)
        staging = size * sum(swap.aligned(numel, size) for numel, _ in largest)
    return StateBytes(
        host + persistent,
        0,
        0,
        host,
        nvme_parameter=files,
        host_buffers=staging + (0 if swap.gds else buffers),
        device_buffers=buffers if swap.gds else 0,
    )


def _zero3_sub_group(sub: Sequence[Piece], zero: ZeroSettings, optimizer: OptimizerKind) -> StateBytes:
    """One optimizer sub-group's fp32 master, moments and fp32 gradient (stage3.py
    `_create_fp32_partitions`, `initialize_optimizer_states`)."""
    elements = _elements(sub)
    swap = zero.swap
    if zero.nvme_optimizer and FP32_BYTES * elements >= swap.min_aio_bytes:  # `_swappable_optimizer_subgroup`
        # swap_tensor/partitioned_optimizer_swapper.py: the master and each moment are one file of
        # the sub-group's elements, read into the swap buffers for its step and released after.
        states = (1 + optimizer.moments) * FP32_BYTES * swap.aligned(elements, FP32_BYTES)
        # stage3.py `_offload_grad_partition_at_boundary`: each parameter's gradient partition goes
        # to `swap_out_gradients` as an fp32 copy, on the device where there is one (in place for
        # fp32 on a host-only rank). optimizer_utils.py `_adjust_for_misaligned_lengths` cuts off
        # the unaligned tail, `_swap_out_gradients` writes the swappable aligned part and keeps
        # the rest as `unswapped_gradients` until the step, and with it the whole copy.
        alignment = swap.aligned_bytes // FP32_BYTES
        copied = zero.accelerator or zero.precision != "fp32"
        written = held = 0
        for _, piece in sub:
            whole = piece - piece % alignment if FP32_BYTES * piece >= swap.min_aio_bytes else 0
            whole = whole if FP32_BYTES * whole >= swap.min_aio_bytes else 0
            written += FP32_BYTES * whole
            held += FP32_BYTES * piece if whole < piece and copied else 0
        return StateBytes(0, held, 0, 0, nvme_gradient=written, nvme_optimizer=states)
    optimizer_bytes = FP32_BYTES * elements + _moment_bytes(
        elements, 1, optimizer, torch_optimizer=not zero.offload_optimizer
    )
    if not zero.offload_optimizer:
        return StateBytes(0, 0, optimizer_bytes, 0)
    # With the optimizer offloaded the gradient is also copied to a pinned fp32 host gradient of the
    # master, and DeepSpeedCPUAdam steps it.
    return StateBytes(0, FP32_BYTES * elements, optimizer_bytes, FP32_BYTES * elements + optimizer_bytes)


def accelerate_state_bytes(
    shapes: Sequence[Sequence[int]],
    wrapper: str,
    world_size: int,
    rank: int,
    optimizer: OptimizerKind,
    offload: bool,
    frozen: Sequence[Sequence[int]] = (),
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

    Either offload key offloads all three (`CPUOffloadPolicy`: the optimizer steps on the host).
    `frozen`: the shapes of the parameters that do not train (model.lora's base): fp32 parameters
    alone, whole under DDP, in the same padded pieces under FSDP2."""
    if wrapper == "ddp":
        total = sum(math.prod(shape) for shape in shapes)
        base = FP32_BYTES * sum(math.prod(shape) for shape in frozen)
        optimizer_bytes = _moment_bytes(total, len(shapes), optimizer, True)
        return StateBytes(FP32_BYTES * total + base, FP32_BYTES * total, optimizer_bytes, 0)
    padded, held = _fsdp_pieces(shapes, world_size, rank)
    parameter = gradient = FP32_BYTES * padded
    optimizer_bytes = _moment_bytes(held, len(shapes), optimizer, True)
    base = FP32_BYTES * _fsdp_pieces(frozen, world_size, rank)[0]
    offloaded = parameter + base + gradient + optimizer_bytes if offload else 0
    return StateBytes(parameter + base, gradient, optimizer_bytes, offloaded)


def _fsdp_pieces(shapes: Sequence[Sequence[int]], world_size: int, rank: int) -> tuple[int, int]:
    """Elements of the padded pieces every rank allocates, and of the rows `rank` holds."""
    padded = held = 0
    for rows, *rest in shapes:
        piece = math.ceil(rows / world_size)
        padded += piece * math.prod(rest)
        held += max(0, min(piece, rows - rank * piece)) * math.prod(rest)
    return padded, held
