"""The end of a run: consolidated fp32 weights in a format the model's own library loads
(`GPT2LMHeadModel` or `LlamaForCausalLM.from_pretrained`, a ResNet `load_state_dict`), plus what
turns raw inputs into the model's (the tokenizer, or the image processor and class names), so the
result outlives this engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from models import ModelFamily

if TYPE_CHECKING:
    from data.transforms import ImageTransform


def export_model(
    family: ModelFamily,
    state_dict: dict[str, torch.Tensor],
    model_config: Mapping[str, Any],
    export_dir: Path,
    *,
    tokenizer: Any | None = None,
    image_transform: ImageTransform | None = None,
    class_names: Sequence[str] | None = None,
) -> None:
    """The weights, with the data's side saved beside them as transformers reads it, so that
    `pipeline(..., model=export_dir)` runs on raw text or images: the tokenizer, or the evaluation
    image transform as an image processor and the class names as the model's labels."""
    export_dir.mkdir(parents=True, exist_ok=True)
    family.export(state_dict, model_config, export_dir, class_names)
    if tokenizer is not None:
        tokenizer.save(export_dir)
    if image_transform is not None:
        image_transform.save_image_processor(export_dir)


def sample_text(family: ModelFamily, export_dir: Path, tokenizer: Any, num_tokens: int, seed: int) -> str:
    """A short continuation from the exported GPT, proving the export is usable on its own.

    Sampled nanoGPT-style with the context cropped to the position table, so the sample may be
    longer than the model's context (transformers' `generate` would index past it).
    """
    model = family.load_export(export_dir).eval()
    context = model.config.max_position_embeddings  # transformers' name for it in every config
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([tokenizer.encode("\n")], dtype=torch.long)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(tokens[:, -context:]).logits[:, -1, :]
            top = torch.topk(logits, k=min(50, logits.size(-1)))
            logits[logits < top.values[:, -1:]] = -float("inf")
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            tokens = torch.cat([tokens, next_token], dim=1)
    return tokenizer.decode(tokens[0].tolist())
