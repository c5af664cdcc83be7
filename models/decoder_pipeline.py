"""What a causal language model needs to run as DeepSpeed pipeline layers: a stage's batch, loss and
evaluation sums, the positions and mask a decoder layer running alone needs, and the tied embedding
as the first and the last layer.

transformers and DeepSpeed are imported inside the functions: config validation reads the family
modules without building a model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models.labels import IGNORE_INDEX
from parallelism.tensor import tied_logits


def pipeline_batch(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(first stage's input, last stage's labels)."""
    return batch["input_ids"], batch["labels"]


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' own causal-LM loss (fp32 logits), given labels the data already shifted: a
    sample of seq_len inputs carries seq_len targets, where shifting inside would score seq_len - 1."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    # It views the labels flat, as its own shift leaves them contiguous.
    return ForCausalLMLoss(logits, None, vocab_size=logits.shape[-1], shift_labels=labels.contiguous())


def pipeline_eval_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed in fp32 logits over the tokens that count (labels other than IGNORE_INDEX)."""
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.float().reshape(flat.numel(), -1), flat, ignore_index=IGNORE_INDEX, reduction="sum")
    return {"loss_sum": loss.detach().double(), "tokens": (flat != IGNORE_INDEX).sum().double()}


def positions_and_mask(config: Any, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a decoder layer running alone as a pipeline layer needs besides its hidden states: the
    position ids of a whole sequence and the causal mask the whole model would build for it (None
    under SDPA, which masks causally itself)."""
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    mask = create_causal_mask(
        config=config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=positions
    )
    return positions, mask


class TiedEmbedding(nn.Module):
    """A tied token embedding as a pipeline layer: looked up on the first stage, the output
    projection on the last (`tied_embedding_layers`). It holds the model's embedding module under
    the model's own name for it, so the tied weight is `wte.weight` or `embed_tokens.weight`."""

    def __init__(self, **embedding: nn.Module):
        super().__init__()
        ((self.key, module),) = embedding.items()
        self.add_module(self.key, module)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.get_submodule(self.key)(input_ids)


def _tied_head(embedding: TiedEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    return tied_logits(embedding.get_submodule(embedding.key), hidden)


def tied_embedding_layers(name: str, embedding: nn.Module) -> tuple[Any, Any]:
    """The first and the last pipeline layer of a model whose head is its token embedding `name`:
    one tied module, so DeepSpeed keeps the first and last stage's copies equal."""
    from deepspeed.pipe import TiedLayerSpec

    weight, module = f"{name}.weight", {name: embedding}
    return (
        TiedLayerSpec("embedding", TiedEmbedding, tied_weight_attr=weight, **module),
        TiedLayerSpec("embedding", TiedEmbedding, forward_fn=_tied_head, tied_weight_attr=weight, **module),
    )
