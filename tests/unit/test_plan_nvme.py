"""The planner under ZeRO-Infinity's NVMe offload, on the CPU: what each rank writes under
nvme_path, what stays in memory and what the swappers page-lock, worked out here by hand from
DeepSpeed 0.19.8's rules (swap_tensor/ and zero/stage3.py) and the tiny GPT's architecture."""

from __future__ import annotations

import math

import pytest

from engine.config import load_config
from engine.launch.hardware import Hardware, detect_hardware
from engine.plan import explain, format_bytes, nvme_bytes, plan_run, table, verdict

TINY = "configs/tiny_gpt.json"
HIDDEN, LAYERS, POSITIONS = 32, 2, 32
# The token embedding is the only tensor big enough to swap: 16385 x 32 = 524320 elements, 2 MiB in
# fp32, and 262160 per rank on two, just over 1 MiB and not a multiple of the 256-element alignment.
VOCAB = 16385
MIB = 2**20
ALIGNMENT = 1024 // 4  # AIO_ALIGNED_BYTES over an fp32 element, one I/O thread
PARAMS, OPTIMIZER = "/local_nvme/params", "/local_nvme/optimizer"
FP32_ZERO3 = ["zero_optimization.stage=3", "bf16.enabled=false", "fp16.enabled=false"]
PARAM_NVME = [
    "zero_optimization.offload_param.device=nvme",
    f"zero_optimization.offload_param.nvme_path={PARAMS}",
    "zero_optimization.offload_param.buffer_count=3",
    "zero_optimization.offload_param.buffer_size=1000000",
    "zero_optimization.offload_optimizer.device=cpu",
]
# A sub-group closes at 262144 elements: the embedding alone, then the other matrices, then the
# vectors (a group within sub_group_size is one sub-group).
OPTIMIZER_NVME = [
    "zero_optimization.offload_optimizer.device=nvme",
    f"zero_optimization.offload_optimizer.nvme_path={OPTIMIZER}",
    "zero_optimization.sub_group_size=262144",
]


def matrix_numels(vocab: int) -> list[int]:
    """The weight-decay group: the embeddings and each block's four weight matrices, in order."""
    block = [3 * HIDDEN * HIDDEN, HIDDEN * HIDDEN, 4 * HIDDEN * HIDDEN, 4 * HIDDEN * HIDDEN]
    return [vocab * HIDDEN, POSITIONS * HIDDEN, *block * LAYERS]


def vector_numels() -> list[int]:
    """The other group: each block's LayerNorm gains and biases, then the final LayerNorm's."""
    block = [HIDDEN, HIDDEN, 3 * HIDDEN, HIDDEN, HIDDEN, HIDDEN, 4 * HIDDEN, HIDDEN]
    return [*block * LAYERS, HIDDEN, HIDDEN]


def io_aligned(numel: int) -> int:
    return math.ceil(numel / ALIGNMENT) * ALIGNMENT


def partition(numels: list[int], ranks: int) -> int:
    return sum(-(-numel // ranks) for numel in numels)


def plan_of(world_size: int, overrides: list[str], device: str = "cuda", ranks_per_node: int | None = None):
    config = load_config(
        TINY,
        [*FP32_ZERO3, f"model.vocab_size={VOCAB}", *overrides],
        world_size=world_size,
        hardware=detect_hardware(local_world_size=world_size),
    )
    node = Hardware(device, True, True, cpu_count=16, local_world_size=ranks_per_node or world_size)
    return plan_run(config, node)


# --- parameters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world_size, vocab, block_size, swapped",
    [
        (1, VOCAB, MIB, True),
        (2, VOCAB, MIB, True),  # 262160 elements: 1 MiB and 64 bytes
        (2, 16383, MIB, False),  # 262128 elements: 64 bytes under 1 MiB, so it stays in host memory
        (1, VOCAB, 4 * MIB, False),  # 2 MiB, under aio.block_size: min_aio_bytes is max(1 MiB, block_size)
    ],
)
def test_a_parameter_partition_is_swapped_from_1_mib_and_read_back_under_max_in_cpu(
    world_size: int, vocab: int, block_size: int, swapped: bool
):
    """At start-up every partition of at least min_aio_bytes is written to NVMe, padded to 1 KiB;
    under the default max_in_cpu (10**9 elements) every sub-group is then read back into the host's
    flat buffer for good, so the host holds all partitions as under cpu offload, the files stay on
    the drive, and the swapper page-locks buffer_count x buffer_size elements besides."""
    plan = plan_of(world_size, [*PARAM_NVME, f"model.vocab_size={vocab}", f"aio.block_size={block_size}"])
    numels = matrix_numels(vocab) + vector_numels()
    embedding = -(-vocab * HIDDEN // world_size)
    files = 4 * io_aligned(embedding) if swapped else 0
    held = partition(numels, world_size)
    persistent = sum(vector_numels())  # at most 10 x hidden elements: gathered on every rank
    for rank in plan.ranks:
        states = rank.states
        assert (states.nvme_parameter, states.nvme_gradient, states.nvme_optimizer) == (files, 0, 0)
        assert states.parameter == 4 * (held + persistent)
        assert states.offloaded == 4 * held + 16 * held  # partitions; fp32 gradient, master and Adam's moments
        assert states.host_buffers == 3 * 4 * io_aligned(1_000_000)  # 1000192 elements each
    assert nvme_bytes(plan) == {PARAMS: world_size * files}
    assert plan.nvme_total == world_size * files
    assert ("nvme" in table(plan).splitlines()[1]) == swapped


@pytest.mark.parametrize("world_size", [1, 2])
def test_with_max_in_cpu_0_the_swapped_partitions_stay_on_nvme(world_size: int):
    """max_in_cpu 0: each group's flat host buffer is `torch.empty(1)`, no sub-group fits it, and every
    partition stays where start-up put it: the embedding's on NVMe, the others in pinned host memory.
    Writing updated partitions back needs a page-locked buffer as big as the largest sub-group, which
    DeepSpeed sizes on its parameters' whole element counts, not their partitions."""
    plan = plan_of(world_size, [*PARAM_NVME, "zero_optimization.offload_param.max_in_cpu=0"])
    matrices, vectors = matrix_numels(VOCAB), vector_numels()
    embedding = -(-matrices[0] // world_size)
    in_memory = partition(matrices[1:] + vectors, world_size)
    # The small partitions and the 2-byte invalid_buffer; each group's one-element flat buffer holds no
    # parameter, and a rank's measurement (what the plan is held to) does not see it.
    host = 4 * in_memory + 2
    for rank in plan.ranks:
        states = rank.states
        assert states.nvme_parameter == 4 * io_aligned(embedding)
        assert states.parameter == host + 4 * sum(vectors)
        staging = 4 * sum(io_aligned(numel) for numel in matrices)  # whole tensors even on two ranks
        assert states.host_buffers == 3 * 4 * io_aligned(1_000_000) + staging
        optimizer = 16 * (embedding + in_memory)  # host fp32 gradient, master, two moments
        assert states.offloaded == host + optimizer


# --- optimizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, vocab", [(1, VOCAB), (2, VOCAB), (2, 16384)])
def test_a_sub_group_is_swapped_from_1_mib_with_its_gradients(world_size: int, vocab: int):
    """sub_group_size 262144: the embedding's sub-group is swapped, its master and both moments one
    padded file each and its gradient's 256-aligned part a file; the other matrices' and the
    vectors' sub-groups are under 1 MiB and stay in host memory. A gradient partition with an
    unaligned tail is held whole, as an fp32 copy on the device, until the step; on a host-only
    rank in fp32 the copy is a view of the reduce-scatter buffer and costs nothing."""
    overrides = [*OPTIMIZER_NVME, f"model.vocab_size={vocab}"]
    gpu, cpu = plan_of(world_size, overrides, "cuda"), plan_of(world_size, overrides, "cpu")
    matrices, vectors = matrix_numels(vocab), vector_numels()
    embedding = -(-matrices[0] // world_size)
    in_memory = partition(matrices[1:] + vectors, world_size)
    held = 4 * embedding if embedding % ALIGNMENT else 0
    assert held or (world_size, vocab) == (2, 16384)  # 262144 elements: aligned, swapped whole
    for rank_gpu, rank_cpu in zip(gpu.ranks, cpu.ranks, strict=True):
        for states in (rank_gpu.states, rank_cpu.states):
            assert states.nvme_optimizer == 3 * 4 * io_aligned(embedding)
            assert states.nvme_gradient == 4 * (embedding - embedding % ALIGNMENT)
            assert states.optimizer == 12 * in_memory
            assert states.offloaded == 16 * in_memory
            assert states.host_buffers == 4 * 4 * io_aligned(embedding)  # buffer_count 4, the largest sub-group
        reduce_scatter = 4 * (embedding + in_memory)
        assert rank_gpu.states.gradient == reduce_scatter + 4 * in_memory + held
        assert rank_cpu.states.gradient == reduce_scatter + 4 * in_memory
    assert nvme_bytes(gpu) == {OPTIMIZER: world_size * gpu.ranks[0].states.nvme}


def test_host_memory_counts_the_swap_buffers_and_not_what_lives_on_nvme():
    """Against optimizer offload to the host: the embedding's sub-group leaves host memory (fp32
    gradient, master, two moments) and the optimizer's four page-locked buffers come in."""
    nvme = plan_of(2, OPTIMIZER_NVME)
    host = plan_of(2, ["zero_optimization.offload_optimizer.device=cpu", "zero_optimization.sub_group_size=262144"])
    embedding = -(-VOCAB * HIDDEN // 2)
    per_rank = -16 * embedding + 4 * 4 * io_aligned(embedding)
    assert nvme.host_total == host.host_total + 2 * per_rank
    fits, text = verdict(nvme, None, nvme.host_total)
    assert fits and "NVMe swap buffers" in text
    assert not verdict(nvme, None, nvme.host_total - 1)[0]


# --- both, per node, and the words -----------------------------------------------------------------


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_nvme_bytes_gives_each_folder_what_the_busiest_node_writes(ranks_per_node: int):
    shared = [*PARAM_NVME, *OPTIMIZER_NVME, "zero_optimization.offload_optimizer.nvme_path=/local_nvme"]
    shared.append("zero_optimization.offload_param.nvme_path=/local_nvme")
    plan = plan_of(2, shared, ranks_per_node=ranks_per_node)
    embedding = -(-VOCAB * HIDDEN // 2)
    per_rank = 4 * io_aligned(embedding) * (1 + 3) + 4 * (embedding - embedding % ALIGNMENT)
    assert [rank.states.nvme for rank in plan.ranks] == [per_rank, per_rank]
    assert nvme_bytes(plan) == {"/local_nvme": ranks_per_node * per_rank}
    assert plan.nvme_total == ranks_per_node * per_rank

    apart = plan_of(2, [*PARAM_NVME, *OPTIMIZER_NVME], ranks_per_node=ranks_per_node)
    parameters = 4 * io_aligned(embedding)
    assert nvme_bytes(apart) == {
        PARAMS: ranks_per_node * parameters,
        OPTIMIZER: ranks_per_node * (per_rank - parameters),
    }


def test_explain_tells_each_rank_what_it_writes_under_which_nvme_path():
    plan = plan_of(2, [*PARAM_NVME, *OPTIMIZER_NVME])
    embedding = -(-VOCAB * HIDDEN // 2)
    text = explain(plan)
    for rank in (0, 1):
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank}:"))
        assert f"parameter partitions {format_bytes(4 * io_aligned(embedding))} under {PARAMS}" in line
        assert (
            f"master weights and optimizer moments {format_bytes(12 * io_aligned(embedding))} under {OPTIMIZER}" in line
        )
        assert f"fp32 gradients {format_bytes(4 * (embedding - embedding % ALIGNMENT))} under {OPTIMIZER}" in line
        assert f"holds {format_bytes(plan.ranks[rank].states.host_buffers)} of host memory in swap buffers" in line
    assert "max(1 MiB, aio.block_size)" in text and "max_in_cpu" in text
    header = table(plan).splitlines()[1].split()
    assert header[header.index("offloaded") + 1] == "nvme"


def test_the_table_adds_no_nvme_column_without_nvme():
    header = table(plan_of(2, ["zero_optimization.offload_optimizer.device=cpu"])).splitlines()[1]
    assert "nvme" not in header and "offloaded" in header


def test_under_gpudirect_storage_the_parameter_swap_buffers_are_device_memory():
    plan = plan_of(1, [*PARAM_NVME, "aio.use_gds=true"])
    swap = plan_of(1, PARAM_NVME)
    buffers = 3 * 4 * io_aligned(1_000_000)
    states = plan.ranks[0].states
    assert (states.device_buffers, states.host_buffers) == (buffers, 0)
    assert plan.device_peak == swap.device_peak + buffers
    assert plan.host_total == swap.host_total - buffers
