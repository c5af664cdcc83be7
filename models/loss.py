"""The causal language models' loss and evaluation sums (the GPT and Llama families), and the label
that every family's loss and evaluation skip."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import torch

from models.attention import model_inputs
from models.labels import IGNORE_INDEX

# math.exp overflows above this; a diverged run should report an infinite perplexity, not crash.
_LARGEST_EXP_ARGUMENT = math.log(sys.float_info.max)


def compute_loss(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], divisor: torch.Tensor | None = None
) -> torch.Tensor:
    """Next-token loss over the target tokens (labels other than IGNORE_INDEX, which arrive already
    one token on): their mean, or their sum over `divisor` (engine/backends/token_mean.py), which
    transformers' loss takes as `num_items_in_batch`.

    The model computes it in its own forward (transformers' `ForCausalLMLoss`, `pipeline_loss`'s
    arithmetic), so that a compiled model compiles the loss with it and never writes fp32 logits."""
    labels = batch["labels"].contiguous()
    loss_arguments = {} if divisor is None else {"num_items_in_batch": divisor}
    # No KV cache: training never decodes, and the cache would cost memory on every forward.
    return model(**model_inputs(batch), labels=labels, shift_labels=labels, use_cache=False, **loss_arguments).loss


def eval_sums(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed token loss and the tokens predicted, so the mean over every rank's batches is exact.

    The model's own loss over a divisor of 1, its sum: model.loss "tiled" and "fused" then evaluate
    without the whole logits as they train, and "full" sums `pipeline_eval_sums`' fp32 cross-entropy."""
    labels = batch["labels"]
    loss_sum = compute_loss(model, batch, torch.ones((), device=labels.device))
    return {"loss_sum": loss_sum.detach().double(), "tokens": (labels != IGNORE_INDEX).sum().double()}


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
    loss = sums["loss_sum"] / sums["tokens"]
    return {"loss": loss, "perplexity": math.exp(loss) if loss <= _LARGEST_EXP_ARGUMENT else math.inf}
