"""model.tiled_mlp (DeepSpeed's TiledMLP) and model.loss "tiled" (models/tiling.py) compute what the
untiled model computes: the same loss and gradients for GPT (tied head) and Llama (untied), with
masked labels, divided by a global target count or not, over several pieces of the MLP and of the
loss; evaluation still gets the logits; no parameter is renamed."""

from __future__ import annotations

import pytest
import torch

import models.common
from models import get_family
from models.common import IGNORE_INDEX, compute_loss, seed_everything, tiled_loss_pieces, tiled_mlp_pieces

VOCAB, LENGTH = 96, 64
SECTIONS = {
    "llama": {"family": "llama", "preset": "tiny", "vocab_size": VOCAB, "max_position_embeddings": LENGTH},
    "gpt": {"family": "gpt", "preset": "tiny", "vocab_size": VOCAB},
}


def built(family: str, **tiling: object) -> torch.nn.Module:
    seed_everything(0)
    return get_family(family).build({**SECTIONS[family], **tiling})


@pytest.fixture
def batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    labels[0, :20] = IGNORE_INDEX  # a prompt
    labels[1, -7:] = IGNORE_INDEX  # padding
    return {"input_ids": torch.randint(0, VOCAB, (2, LENGTH), generator=generator), "labels": labels}


@pytest.mark.parametrize("family", list(SECTIONS))
@pytest.mark.parametrize("divisor", [None, 40.0], ids=["mean", "global_count"])
def test_tiled_mlp_and_loss_give_the_untiled_loss_and_gradients(
    family: str, divisor: float | None, batch: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
):
    # Pieces of 16 positions' logits: 8 pieces of the loss; the MLP cuts 64 positions of width 32 or
    # 64 into 2 or 1 pieces.
    monkeypatch.setattr(models.common, "LOSS_PIECE_BYTES", 16 * VOCAB * 4)
    assert tiled_loss_pieces(2 * LENGTH, VOCAB) == 8
    plain, tiled = built(family), built(family, tiled_mlp=True, loss="tiled")
    assert plain.state_dict().keys() == tiled.state_dict().keys()
    count = None if divisor is None else torch.tensor(divisor)
    expected, loss = compute_loss(plain, batch, count), compute_loss(tiled, batch, count)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, parameter), twin in zip(plain.named_parameters(), tiled.parameters(), strict=True):
        torch.testing.assert_close(twin.grad, parameter.grad, rtol=0, atol=1e-6, msg=name)


def test_llama_mlp_is_cut_into_pieces(batch: dict[str, torch.Tensor]):
    """The tiny Llama's width (32) makes 2 MLP pieces of its 64 positions: the test above tiles."""
    assert tiled_mlp_pieces(LENGTH, built("llama").config.hidden_size) == 2


@pytest.mark.parametrize("family", list(SECTIONS))
def test_evaluation_still_gets_the_logits(family: str, batch: dict[str, torch.Tensor]):
    plain, tiled = built(family).eval(), built(family, tiled_mlp=True, loss="tiled").eval()
    with torch.no_grad():
        expected = plain(input_ids=batch["input_ids"]).logits
        torch.testing.assert_close(tiled(input_ids=batch["input_ids"]).logits, expected, rtol=0, atol=1e-6)
