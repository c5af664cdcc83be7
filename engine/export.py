"""The end of a run: consolidated fp32 weights in a format the model's own library loads
(`GPT2LMHeadModel.from_pretrained`, a ResNet `load_state_dict`), plus the tokenizer, so the
result outlives this engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models import ModelFamily


def export_model(
    family: ModelFamily,
    state_dict: dict[str, torch.Tensor],
    model_config: dict[str, Any],
    export_dir: Path,
    tokenizer: Any | None,
) -> None:
    export_dir.mkdir(parents=True, exist_ok=True)
    family.export(state_dict, model_config, export_dir)
    if tokenizer is not None:
        tokenizer.save(export_dir)


def sample_text(family: ModelFamily, export_dir: Path, tokenizer: Any, num_tokens: int, seed: int) -> str:
    """A short continuation from the exported GPT, proving the export is usable on its own."""
    model = family.load_export(export_dir).eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    prompt = torch.tensor([tokenizer.encode("\n")], dtype=torch.long)
    with torch.no_grad():
        output = model.generate(
            prompt,
            max_new_tokens=num_tokens,
            do_sample=True,
            top_k=50,
            pad_token_id=model.config.eos_token_id,
            eos_token_id=None,
        )
    torch.random.set_rng_state(generator_state)
    return tokenizer.decode(output[0].tolist())
