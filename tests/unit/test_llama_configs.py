"""The ready Llama configs, planned in one process for the GPUs they are written for: Llama 3.2 1B on
one node of 8 (ZeRO-2) and Llama 3 8B on 4 nodes of 8 (TP 8 x PP 2 x DP 2, ZeRO-1). The per-rank
parameter and optimizer bytes are worked out here from the published shapes, not copied from the
planner; the verdict is against an 80 GiB device. Nothing is allocated: the models are built on the
meta device, and the configs' synthetic data is generated on demand."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import load_config
from engine.launch.hardware import Hardware
from engine.plan import data_sizes, plan_run, verdict
from engine.preflight import load_data

ROOT = Path(__file__).resolve().parents[2]
GPUS_PER_NODE = 8
DEVICE_MEMORY = 80 * 2**30
VOCAB = 128256  # Llama 3's tokenizer
BF16, FP32 = 2, 4
ADAM = 3 * FP32  # DeepSpeed's fp32 master weights and Adam's two moments, per trainable element
# torch's Adam (the default on a GPU: no FusedAdam build) keeps one fp32 step count per parameter group.
ADAM_STEPS = 2 * FP32  # the decayed group and the undecayed one


def gpu_node() -> Hardware:
    """A node of 8 bf16 GPUs, whatever this machine is (the planner then counts device memory)."""
    return Hardware("cuda", True, True, cpu_count=16, local_world_size=GPUS_PER_NODE, name="NVIDIA H100 80GB HBM3")


def planned(name: str, world_size: int):
    config = load_config(ROOT / "configs" / name, [], world_size=world_size, hardware=gpu_node())
    return plan_run(config, gpu_node(), data_sizes(load_data(config)))


def layer_numels(hidden: int, heads: int, kv_heads: int, inner: int) -> tuple[int, int]:
    """One decoder layer's (matrix, norm) elements: q and o are hidden x hidden, k and v project to
    the key/value heads only (grouped-query attention), gate/up/down are the SwiGLU MLP, and two
    RMSNorm weights of width hidden."""
    kv_width = kv_heads * (hidden // heads)
    return 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inner, 2 * hidden


def aligned(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def test_llama_1b_fits_one_node_of_80gib_gpus_under_zero2():
    hidden, layers = 2048, 16
    matrices, norms = layer_numels(hidden, heads=32, kv_heads=8, inner=8192)
    # The head is tied to the embedding (Llama 3.2 1B): one V x h matrix; the final norm.
    decayed, undecayed = VOCAB * hidden + layers * matrices, layers * norms + hidden
    total = decayed + undecayed
    assert total == 1_235_814_400  # Llama 3.2 1B's published count

    plan = planned("llama_1b.json", GPUS_PER_NODE)
    config = plan.config
    assert (config.zero_stage, config.precision, config.dp_size) == (2, "bf16", 8)
    document = config.document
    assert document["train_batch_size"] * config.data.seq_len == 2**20  # a million tokens a step
    assert plan.checkpointing and not plan.one_pool
    for rank in plan.ranks:
        # ZeRO-2 keeps every bf16 weight on every rank and partitions the optimizer: each group padded
        # to a multiple of 2 x dp, then an eighth of it.
        assert rank.states.parameter == BF16 * total
        partition = ADAM * sum(aligned(group, 2 * 8) for group in (decayed, undecayed)) // 8
        assert rank.states.optimizer == partition + ADAM_STEPS
        assert rank.states.offloaded == 0
    fits, text = verdict(plan, DEVICE_MEMORY, None)
    assert fits, text
    assert plan.device_peak < DEVICE_MEMORY / 2  # room left: activations are an estimate


def test_llama_8b_fits_4_nodes_under_tp8_pp2_zero1():
    hidden, layers, tensor, stages, data = 4096, 32, 8, 2, 2
    matrices, norms = layer_numels(hidden, heads=32, kv_heads=8, inner=14336)
    assert 32 % tensor == 0 and 8 % tensor == 0  # one key/value head per shard
    embedding = head = VOCAB * hidden  # untied (Llama 3 8B)
    total = embedding + layers * (matrices + norms) + hidden + head
    assert total == 8_030_261_248  # Llama 3 8B's published count

    # Partitioned by type: 16 decoder layers a stage, the embedding before the first, the final norm
    # and the head after the last. Tensor parallelism splits every matrix 8 ways (the embedding and
    # head by vocabulary rows) and keeps the RMSNorm weights whole on each shard.
    stage_layers = layers // stages
    shard = [
        (embedding // tensor + stage_layers * matrices // tensor, stage_layers * norms),
        (head // tensor + stage_layers * matrices // tensor, stage_layers * norms + hidden),
    ]
    replicated_norms = layers * norms + hidden
    assert tensor * sum(sum(groups) for groups in shard) == total + (tensor - 1) * replicated_norms
    assert abs(sum(shard[0]) / (total / (tensor * stages)) - 1) < 1e-3  # about 8.03e9 / 16 a rank

    plan = planned("llama_8b.json", 4 * GPUS_PER_NODE)
    config = plan.config
    assert (config.zero_stage, config.precision, config.dp_size) == (1, "bf16", data)
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size) == (tensor, stages)
    document = config.document
    assert document["train_batch_size"] * config.data.seq_len == 2**20  # a million tokens a step
    assert plan.checkpointing and not plan.one_pool
    assert plan.bubble == pytest.approx((stages - 1) / (document["gradient_accumulation_steps"] + stages - 1))
    for rank in plan.ranks:
        where = rank.where
        # The 8 tensor shards of a stage are consecutive ranks: one node each, on NVLink.
        assert where.tensor == rank.rank % GPUS_PER_NODE
        decayed, undecayed = shard[where.stage]
        assert rank.states.parameter == BF16 * (decayed + undecayed), rank.rank
        # ZeRO-1 over the 2 data-parallel replicas of a shard.
        optimizer = ADAM * sum(aligned(group, 2 * data) for group in (decayed, undecayed)) // data
        assert rank.states.optimizer == optimizer + ADAM_STEPS, rank.rank
    fits, text = verdict(plan, DEVICE_MEMORY, None)
    assert fits, text


def test_llama_1b_at_128k_tokens_fits_one_node_only_by_splitting_each_sequence_8_ways():
    """configs/llama_1b_128k_sp.json, planned as its comment says: ZeRO-3 partitions every parameter
    over all 8 ranks, which are one data-parallel replica's 8 sequence shards; the same run without
    sequence parallelism does not fit."""
    hidden, layers, sequence, heads, kv_heads, inner = 2048, 16, 8, 32, 8, 8192
    kv_width = kv_heads * hidden // heads
    layer = [hidden * hidden, hidden * kv_width, hidden * kv_width, hidden * hidden, *[hidden * inner] * 3]
    numels = [VOCAB * hidden, *(layer + [hidden, hidden]) * layers, hidden]
    assert sum(numels) == 1_235_814_400  # Llama 3.2 1B's published count

    plan = planned("llama_1b_128k_sp.json", GPUS_PER_NODE)
    config = plan.config
    assert (config.zero_stage, config.precision, config.dp_size) == (3, "bf16", 1)
    assert config.parallel.sequence_parallel_size == sequence and config.data.seq_len == 131072
    assert config.document["train_batch_size"] * config.data.seq_len == 2**20  # a million tokens a step
    # Each parameter padded to a multiple of the 8 ZeRO ranks, an eighth on each; the RMSNorm weights
    # (under the resolved persistence threshold of 10 x hidden) are also held whole after each step.
    partition = sum(-(-numel // sequence) for numel in numels)
    persistent = sum(numel for numel in numels if numel <= 10 * hidden)
    for rank in plan.ranks:
        assert (rank.where.data, rank.where.sequence) == (0, rank.rank)
        assert rank.states.parameter == BF16 * (partition + persistent)
        assert rank.states.gradient == BF16 * partition
        assert rank.states.optimizer == ADAM * partition + ADAM_STEPS
    fits, text = verdict(plan, DEVICE_MEMORY, None)
    assert fits, text

    whole = load_config(
        ROOT / "configs" / "llama_1b_128k_sp.json",
        ["parallel.sequence_parallel_size=1"],
        world_size=GPUS_PER_NODE,
        hardware=gpu_node(),
    )
    fits, text = verdict(plan_run(whole, gpu_node(), None), DEVICE_MEMORY, None)
    assert not fits, text
