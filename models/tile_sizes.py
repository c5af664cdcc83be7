"""ALST's tiling (models/tiling.py: model.tiled_mlp, model.loss "tiled" and its fallback for "fused"):
how many pieces a rank's tokens are cut into, what the runtime runs and the planner counts."""

from __future__ import annotations

import math

AUTO_LOSS = "auto"  # model.loss's default: "fused" where it holds less and runs, else "full"
# fp32 logits of one piece of the tiled and fused losses: 8 pieces of a Llama 3 sequence of 2048 tokens,
# each position block large enough for an efficient matmul (docs/benchmarks.md, memory-walls).
LOSS_PIECE_BYTES = 2**27


def tiled_mlp_pieces(tokens: int, hidden: int) -> int:
    """TiledMLP's pieces of a sequence slice of `tokens`: ALST's ceil(tokens / hidden), so no piece's
    intermediate activations outgrow the hidden states of the whole slice."""
    return max(1, math.ceil(tokens / hidden))


def tiled_loss_pieces(tokens: int, vocab: int) -> int:
    """The tiled loss's pieces of `tokens` positions (models/tiling.py): each piece's fp32 logits at most
    LOSS_PIECE_BYTES."""
    return max(1, math.ceil(tokens * vocab * 4 / LOSS_PIECE_BYTES))
