"""Each rank's slice of a batch under Ulysses sequence parallelism (engine/parallel/sequence.py):
the slices of a group put back together are the batch, each carrying its tokens' positions in the
whole sequence, and a conversation batch whose length the degree does not divide is padded with
targets that count for nothing."""

from __future__ import annotations

import torch

from engine.parallel.sequence import SequenceShards
from models.attention import SHARD_POSITIONS, model_inputs
from models.labels import IGNORE_INDEX


def shards(size: int) -> list[SequenceShards]:
    return [SequenceShards(size=size, rank=rank, data_group=None, groups=None, grad_scale=1.0) for rank in range(size)]


def test_the_slices_of_a_group_make_up_the_batch():
    batch = {"input_ids": torch.arange(24).reshape(2, 12), "labels": torch.arange(1, 25).reshape(2, 12)}
    sliced = [shard.shard(dict(batch)) for shard in shards(3)]
    for key in batch:
        torch.testing.assert_close(torch.cat([piece[key] for piece in sliced], dim=1), batch[key])
    positions = torch.cat([piece[SHARD_POSITIONS] for piece in sliced], dim=1)
    torch.testing.assert_close(positions, torch.arange(12).expand(2, -1))
    # The model is given the slice's positions and no mask: Ulysses gathers them and masks causally.
    inputs = model_inputs(sliced[1])
    assert set(inputs) == {"input_ids", "position_ids"}
    torch.testing.assert_close(inputs["position_ids"], torch.arange(4, 8).expand(2, -1))


def test_a_length_the_degree_does_not_divide_is_padded_with_ignored_targets():
    batch = {"input_ids": torch.ones(1, 10, dtype=torch.long), "labels": torch.full((1, 10), 7)}
    sliced = [shard.shard(dict(batch)) for shard in shards(4)]
    assert [piece["input_ids"].shape[1] for piece in sliced] == [3, 3, 3, 3]
    labels = torch.cat([piece["labels"] for piece in sliced], dim=1)
    assert labels[0, :10].eq(7).all() and labels[0, 10:].eq(IGNORE_INDEX).all()
