"""The parallel forms of the model families, in one process: pipeline layers compute exactly what
the unsplit model does, tensor-parallel shards reassemble into the full weights, and the rank
layout puts tensor shards on adjacent ranks. The launched runs are in test_model_parallel.py."""

from __future__ import annotations

import pytest
import torch
from deepspeed.pipe import TiedLayerSpec

from engine.parallel.layout import Coordinates, ParallelLayout
from models import get_family
from models.resnet import logits_of
from parallelism.tensor import Shard, shard_tensor, unshard_tensors


def run_layers(layers: list, inputs: torch.Tensor) -> torch.Tensor:
    """The layer list walked as one pipeline stage would, tied layers built the way DeepSpeed builds them."""
    hidden = inputs
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            module = layer.build()
            hidden = layer.forward_fn(module, hidden) if layer.forward_fn else module(hidden)
        else:
            hidden = layer(hidden)
    return hidden


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_gpt_pipeline_layers_compute_the_model_exactly(attention: str):
    family = get_family("gpt")
    torch.manual_seed(0)
    model = family.build(
        {"preset": "tiny", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 65, "attn_implementation": attention}
    ).eval()
    tokens = torch.randint(0, 65, (2, 16))
    expected = model(input_ids=tokens, labels=tokens, use_cache=False)
    logits = run_layers(family.pipeline.layers(model), tokens)
    assert torch.equal(logits, expected.logits)
    # The data hand the labels over already shifted; transformers shifts inside: the same 15 targets.
    shifted = family.pipeline.loss(logits[:, :-1].contiguous(), tokens[:, 1:])
    torch.testing.assert_close(shifted, expected.loss, rtol=1e-6, atol=0)


def test_gpt_pipeline_ties_the_head_to_the_embedding():
    model = get_family("gpt").build({"preset": "tiny", "vocab_size": 65})
    layers = get_family("gpt").pipeline.layers(model)
    first, last = layers[0], layers[-1]
    assert isinstance(first, TiedLayerSpec) and isinstance(last, TiedLayerSpec)
    assert first.key == last.key and last.forward_fn is not None
    assert first.build().wte.weight is model.lm_head.weight


def test_resnet_pipeline_layers_compute_the_model_exactly():
    family = get_family("resnet")
    torch.manual_seed(0)
    model = family.build({"preset": "resnet18", "num_classes": 10}).eval()
    images = torch.randn(2, 3, 32, 32)
    layers = family.pipeline.layers(model)
    assert len(layers) == family.pipeline.num_blocks(family.architecture({"preset": "resnet18"})) + 2
    assert torch.equal(run_layers(layers, images), logits_of(model(images)))


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_shards_reassemble_into_the_full_tensor(dim: int, chunks: int):
    full = torch.arange(12 * 24, dtype=torch.float32).reshape(12, 24)
    shard = Shard(dim, chunks)
    pieces = [shard_tensor(full, shard, rank, 2) for rank in range(2)]
    assert all(piece.shape[dim] == full.shape[dim] // 2 for piece in pieces)
    assert torch.equal(unshard_tensors(pieces, shard), full)


def test_fused_qkv_shard_keeps_whole_heads_of_each_projection():
    width = 8  # q, k, v of 8 columns each; 2 heads of 4 per projection
    full = torch.arange(3 * width).repeat(2, 1)
    second = shard_tensor(full, Shard(1, chunks=3), rank=1, size=2)
    assert second[0].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_layout_puts_tensor_shards_on_adjacent_ranks_and_stages_in_blocks():
    layout = ParallelLayout(data=2, pipeline=2, tensor=2)
    assert [layout.coordinates(rank) for rank in range(4)] == [
        Coordinates(stage=0, data=0, tensor=0),
        Coordinates(stage=0, data=0, tensor=1),
        Coordinates(stage=0, data=1, tensor=0),
        Coordinates(stage=0, data=1, tensor=1),
    ]
    assert {layout.coordinates(rank).stage for rank in range(4, 8)} == {1}
    table = layout.describe(["layers 0-3", "layers 4-6"])
    assert "rank 5: stage 2/2 (layers 4-6), tensor shard 2/2, data replica 1/2" in table
