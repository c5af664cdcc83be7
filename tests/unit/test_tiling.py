"""model.tiled_mlp (DeepSpeed's TiledMLP) and model.loss "tiled", "fused" and "auto"
(models/tiling.py; on the CPU "fused" is the engine's PyTorch fused linear cross-entropy) compute
what the untiled model computes: the same loss and gradients for GPT (tied head) and Llama (untied
and tied), with masked labels, divided by a global target count or not, over several pieces of the
MLP and of the loss; compiled into one graph, under ZeRO-3 and behind the vocabulary-split heads of
tensor parallelism (a group of one here: two ranks train in tests/launched/test_model_parallel.py's
tp2 row); the evaluation sums are the full logits' sums; evaluation without labels still gets the
logits; no parameter is renamed."""

from __future__ import annotations

import pytest
import torch

import models.tile_sizes
from models import get_family
from models.decoder_pipeline import pipeline_eval_sums
from models.labels import IGNORE_INDEX
from models.loss import compute_loss, eval_sums
from models.seeding import seed_everything
from models.tile_sizes import tiled_loss_pieces, tiled_mlp_pieces
from parallelism.tensor import apply_tensor_parallel
from tests.support.process_group import world_of_one  # noqa: F401 (a fixture: pytest finds it by name)

VOCAB, LENGTH = 96, 64
SECTIONS = {
    "llama": {"family": "llama", "preset": "tiny", "vocab_size": VOCAB, "max_position_embeddings": LENGTH},
    "gpt": {"family": "gpt", "preset": "tiny", "vocab_size": VOCAB},
}
SECTIONS["llama_tied"] = {**SECTIONS["llama"], "tie_word_embeddings": True}
# "auto" at eight pieces is "fused" (a plain head): each must equal the full logits' loss.
LOSSES = ["tiled", "fused", "auto"]


def built(family: str, **tiling: object) -> torch.nn.Module:
    seed_everything(0)
    section = SECTIONS[family]
    return get_family(section["family"]).build({**section, "loss": "full", **tiling})


@pytest.fixture
def eight_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 16 positions' logits: 8 pieces of the loss of a batch of 2 x 64."""
    monkeypatch.setattr(models.tile_sizes, "LOSS_PIECE_BYTES", 16 * VOCAB * 4)
    assert tiled_loss_pieces(2 * LENGTH, VOCAB) == 8


def assert_same_gradients(expected: torch.nn.Module, gradients: list[torch.Tensor]) -> None:
    for (name, parameter), grad in zip(expected.named_parameters(), gradients, strict=True):
        torch.testing.assert_close(grad, parameter.grad, rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    labels[0, :20] = IGNORE_INDEX  # a prompt
    labels[1, -7:] = IGNORE_INDEX  # padding
    return {"input_ids": torch.randint(0, VOCAB, (2, LENGTH), generator=generator), "labels": labels}


@pytest.mark.usefixtures("eight_pieces")
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("family", list(SECTIONS))
@pytest.mark.parametrize("divisor", [None, 40.0], ids=["mean", "global_count"])
def test_tiled_mlp_and_loss_give_the_untiled_loss_and_gradients(
    family: str, loss_name: str, divisor: float | None, batch: dict[str, torch.Tensor]
):
    # The MLP cuts 64 positions of width 32 or 64 into 2 or 1 pieces.
    plain, tiled = built(family), built(family, tiled_mlp=True, loss=loss_name)
    assert plain.state_dict().keys() == tiled.state_dict().keys()
    count = None if divisor is None else torch.tensor(divisor)
    expected, loss = compute_loss(plain, batch, count), compute_loss(tiled, batch, count)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert_same_gradients(plain, [parameter.grad for parameter in tiled.parameters()])


@pytest.mark.usefixtures("eight_pieces")
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("family", list(SECTIONS))
def test_evaluation_sums_the_pieces_as_the_full_logits_would(
    family: str, loss_name: str, batch: dict[str, torch.Tensor]
):
    plain, tiled = built(family).eval(), built(family, loss=loss_name).eval()
    with torch.no_grad():
        full = pipeline_eval_sums(plain(input_ids=batch["input_ids"]).logits, batch["labels"])
        sums, tiled_sums = eval_sums(plain, batch), eval_sums(tiled, batch)
        assert tiled(input_ids=batch["input_ids"], shift_labels=batch["labels"]).logits is None
    assert sums["tokens"] == tiled_sums["tokens"] == full["tokens"] == (batch["labels"] != IGNORE_INDEX).sum()
    torch.testing.assert_close(sums["loss_sum"], full["loss_sum"], rtol=1e-7, atol=0)
    torch.testing.assert_close(tiled_sums["loss_sum"], full["loss_sum"], rtol=1e-6, atol=0)


@pytest.mark.usefixtures("eight_pieces")
@pytest.mark.parametrize("loss_name", LOSSES)
def test_the_loss_compiles_into_one_graph_with_the_model(loss_name: str, batch: dict[str, torch.Tensor]):
    """As DeepSpeed's `engine.compile()` compiles it (`Module.compile`, which calls the instance's
    forward): every piece, with its checkpoint or its gradients, in one graph. AOT autograd without
    inductor's code generation, which would cost half a minute of C++ compilation here."""
    plain, tiled = built("llama"), built("llama", loss=loss_name)
    tiled.compile(backend="aot_eager", fullgraph=True)
    expected, loss = compute_loss(plain, batch), compute_loss(tiled, batch)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert_same_gradients(plain, [parameter.grad for parameter in tiled.parameters()])


@pytest.mark.usefixtures("eight_pieces", "world_of_one")
@pytest.mark.parametrize("loss_name", LOSSES)
def test_under_zero3_the_pieces_gather_the_partitioned_head(loss_name: str, batch: dict[str, torch.Tensor]):
    """ZeRO-3 holds the head's weight whole only inside the head's forward, which each piece calls."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    plain, tiled = built("llama"), built("llama", loss=loss_name)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}
    engine, *_ = deepspeed.initialize(model=tiled, model_parameters=tiled.parameters(), config=config)
    assert tiled.lm_head.weight.numel() == 0  # partitioned
    count = torch.tensor(40.0)
    expected, loss = compute_loss(plain, batch, count), compute_loss(engine, batch, count)
    expected.backward()
    engine.backward(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert_same_gradients(plain, [safe_get_full_grad(parameter) for parameter in tiled.parameters()])


@pytest.mark.usefixtures("eight_pieces", "world_of_one")
@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_vocabulary_split_heads_give_each_piece_its_logits(
    family: str, loss_name: str, batch: dict[str, torch.Tensor]
):
    """GPT's tied head becomes the sharded embedding's projection (TiedVocabHead), Llama's untied one
    a VocabParallelHead: each piece calls the head as the full logits would."""
    import torch.distributed as dist

    plain, tiled = built(family), built(family, loss=loss_name)
    apply_tensor_parallel(tiled, get_family(family).tensor_parallel, dist.group.WORLD)
    assert type(tiled.get_output_embeddings()).__name__ == ("TiedVocabHead" if family == "gpt" else "VocabParallelHead")
    expected, loss = compute_loss(plain, batch), compute_loss(tiled, batch)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert_same_gradients(plain, [parameter.grad for parameter in tiled.parameters()])


def test_llama_mlp_is_cut_into_pieces(batch: dict[str, torch.Tensor]):
    """The tiny Llama's width (32) makes 2 MLP pieces of its 64 positions: the test above tiles."""
    assert tiled_mlp_pieces(LENGTH, built("llama").config.hidden_size) == 2


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_evaluation_still_gets_the_logits(family: str, batch: dict[str, torch.Tensor]):
    plain, tiled = built(family).eval(), built(family, tiled_mlp=True, loss="tiled").eval()
    with torch.no_grad():
        expected = plain(input_ids=batch["input_ids"]).logits
        torch.testing.assert_close(tiled(input_ids=batch["input_ids"]).logits, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", list(SECTIONS))
def test_auto_is_the_models_own_loss_where_the_logits_fit_one_piece(family: str, batch: dict[str, torch.Tensor]):
    """model.loss "auto" (the default) keeps transformers' own loss, bit for bit, where the fused loss
    would hold no less; with more than one piece it is the fused loss, bit for bit."""
    assert tiled_loss_pieces(2 * LENGTH, VOCAB) == 1
    plain, auto = built(family), built(family, loss="auto")
    expected, loss = compute_loss(plain, batch, None), compute_loss(auto, batch, None)
    expected.backward()
    loss.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), auto.parameters(), strict=True))


@pytest.mark.usefixtures("eight_pieces")
def test_auto_is_the_fused_loss_where_the_logits_span_pieces(batch: dict[str, torch.Tensor]):
    fused, auto = built("llama", loss="fused"), built("llama", loss="auto")
    assert torch.equal(compute_loss(auto, batch, None), compute_loss(fused, batch, None))
