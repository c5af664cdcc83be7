"""The planner under Ulysses sequence parallelism and ALST's tiling, on the CPU without launches: the
structure of its numbers (a sequence shard's activations against one rank's whole sequence, ZeRO's
partition over every replica's shards, what the tiled loss and MLP take away), worked out here from
the shapes, and what `explain` tells each rank of a group. configs/llama_1b_128k_sp.json is planned
in tests/unit/test_llama_configs.py."""

from __future__ import annotations

import pytest

from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.plan import explain, plan_run, table
from models.tile_sizes import LOSS_PIECE_BYTES

LLAMA = "configs/llama_tiny.json"
# The tiny Llama (width 32, 4 query heads, 2 key/value heads, 2 layers, intermediate 64) on 64-token
# sequences, with its vocabulary given so the plan reads no data.
TINY = ["model.max_position_embeddings=64", "data.seq_len=64", "model.vocab_size=256"]
LAYERS, INTERMEDIATE = 2, 64


def planned(world_size: int, sequence: int, *overrides: str):
    hardware = detect_hardware(local_world_size=world_size)
    sets = [*TINY, f"parallel.sequence_parallel_size={sequence}", *overrides]
    return plan_run(load_config(LLAMA, sets, world_size=world_size, hardware=hardware), hardware)


def activations(plan, checkpointing: bool) -> int:
    """The busiest rank's activations with activation checkpointing on or off."""
    return max(
        rank.activations if bool(plan.checkpointing) == checkpointing else rank.activations_other for rank in plan.ranks
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointed"])
def test_a_sequence_shard_holds_its_slice_of_every_activation(checkpointing: bool):
    """At SP 2 a rank holds half of each sequence outside attention and, inside it, the whole sequence
    for half the heads: every term of the estimate halves (the same micro-batch, the same world)."""
    whole, halves = planned(2, 1), planned(2, 2)
    assert halves.config.dp_size == 1 and whole.config.dp_size == 2
    sp1, sp2 = activations(whole, checkpointing), activations(halves, checkpointing)
    assert sp2 < sp1
    assert abs(sp1 - 2 * sp2) <= 4  # each term rounded to whole bytes


def test_key_value_heads_fewer_than_the_ranks_are_repeated_on_each():
    """At SP 4 the 2 key/value heads are repeated over 2 ranks each: a rank holds more than a quarter
    of one process's keys and values, so more than a quarter of its activations."""
    whole, quarters = planned(4, 1), planned(4, 4)
    assert 4 * activations(quarters, False) > activations(whole, False)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_partitions_the_states_over_every_replicas_sequence_shards(stage: int):
    """Every rank of a replica's group holds the same weights, so ZeRO partitions over data x
    sequence ranks: 2 replicas x 2 shards hold what 4 replicas do, rank by rank."""
    zero = f"zero_optimization.stage={stage}"
    replicas, shards = planned(4, 1, zero), planned(4, 2, zero)
    assert shards.config.dp_size == 2 and shards.adam_share == replicas.adam_share == "1/4"
    assert [rank.states for rank in shards.ranks] == [rank.states for rank in replicas.ranks]
    # The gradients are reduced over the same 4 ranks; the all-to-alls come on top.
    for shard, replica in zip(shards.ranks, replicas.ranks, strict=True):
        assert shard.communication.data_parallel == replica.communication.data_parallel
        assert shard.communication.sequence_parallel > 0 == replica.communication.sequence_parallel


def test_the_tiled_loss_holds_the_logits_of_one_piece():
    """model.loss "tiled": two fp32 tensors of logits (their log-softmax and its gradient) of one piece
    of at most LOSS_PIECE_BYTES, where the full loss holds three of all the rank's tokens."""
    vocab, tokens = 2**19, 1024  # 2 GiB of fp32 logits: 16 pieces
    sets = ["model.max_position_embeddings=1024", f"data.seq_len={tokens}", f"model.vocab_size={vocab}"]
    sets.append("train_micro_batch_size_per_gpu=1")
    hardware = detect_hardware(local_world_size=1)

    def peak(loss: str) -> int:
        config = load_config(LLAMA, [*sets, f"model.loss={loss}"], world_size=1, hardware=hardware)
        return plan_run(config, hardware).ranks[0].activations

    logits = 4 * tokens * vocab
    assert peak("full") - peak("tiled") == 3 * logits - 2 * LOSS_PIECE_BYTES


def test_the_tiled_mlp_keeps_its_intermediate_activations_for_one_piece_of_one_layer():
    """model.tiled_mlp: the SwiGLU's four intermediate tensors (gate, SiLU, up, product) are no longer
    kept by every layer, only by the piece being recomputed (64-token sequences of a 32-wide model: two
    pieces). With every layer's activations kept, that saves (layers - 1) x those tensors more than with
    the layers recomputed, where one layer holds them."""
    tiled = "model.tiled_mlp=true"

    def saved(checkpointing: bool) -> int:
        return activations(planned(1, 1), checkpointing) - activations(planned(1, 1, tiled), checkpointing)

    plan = planned(1, 1)
    element = 4 if plan.config.compute_precision == "fp32" else 2
    tokens = plan.config.data.seq_len * plan.config.document["train_micro_batch_size_per_gpu"]
    assert 0 < saved(True) < saved(False)
    assert abs(saved(False) - saved(True) - (LAYERS - 1) * tokens * 4 * INTERMEDIATE * element) <= 4


def test_explain_tells_each_shard_its_tokens_heads_and_zero_partition():
    text = explain(planned(2, 2, "zero_optimization.stage=3"))
    assert "2 rank(s): 1 data-parallel replica(s) x 2 sequence shard(s) (Ulysses), ZeRO-3 over all 2" in text
    first, second = (line for line in text.splitlines() if line.startswith("rank "))
    assert (
        "sequence shard 1 of 2: tokens 0-31 of every 64-token sequence, and inside attention the whole sequence "
        "for query heads 0-1 of 4 and key/value head 0 of 2; ZeRO partition 1 of 2" in first
    )
    assert "tokens 32-63" in second and "query heads 2-3 of 4 and key/value head 1 of 2" in second
    assert "all-to-alls around attention" in second
    repeated = explain(planned(4, 4)).splitlines()[2]
    assert "query head 1 of 4 and key/value head 0 of 2 (repeated over 2 ranks)" in repeated


def test_the_table_gives_each_rank_its_sequence_shard():
    header, *rows = table(planned(2, 2)).splitlines()[1:4]
    assert header.split()[:5] == ["rank", "stage", "tp", "dp", "sp"]
    assert [row.split()[4] for row in rows] == ["0", "1"]
    assert "sp" not in table(planned(2, 1)).splitlines()[1].split()


@pytest.mark.parametrize(
    "sets, world_size, expected",
    [
        (["model.vocab_size=256"], 1, "full"),  # the logits of a micro-batch are one piece
        (["model.vocab_size=131072", "data.seq_len=512"], 1, "fused"),  # 512 MiB of logits: four pieces
        # A head that ZeRO-3 partitions (on one rank ZeRO-3 takes the single-rank route, whole).
        (["model.vocab_size=131072", "data.seq_len=512", "zero_optimization.stage=3"], 2, "full"),
    ],
    ids=["one_piece", "four_pieces", "zero3"],
)
def test_the_resolved_config_says_which_loss_auto_is(sets: list[str], world_size: int, expected: str):
    hardware = detect_hardware(local_world_size=world_size)
    config = load_config(LLAMA, ["model.max_position_embeddings=1024", *sets], world_size=world_size, hardware=hardware)
    assert config.model.loss == expected
