"""The end of a run: consolidated fp32 weights in a format the model's own library loads
(`GPT2LMHeadModel` or `LlamaForCausalLM.from_pretrained`, a ResNet `load_state_dict`), plus what
turns raw inputs into the model's (the tokenizer, or the image processor and class names), so the
result outlives this engine. A LoRA run (model.lora) exports peft's adapter directory on its base,
or with trainer.export_merge_lora the merged model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from models import ModelFamily
from models.lora import export_adapter, is_adapter_export, load_adapter, merged_model

if TYPE_CHECKING:
    from data.transforms import ImageTransform


def export_model(
    family: ModelFamily,
    state_dict: dict[str, torch.Tensor],
    model_config: Mapping[str, Any],
    export_dir: Path,
    *,
    tokenizer: Any | None = None,
    chat_template: str | None = None,
    image_transform: ImageTransform | None = None,
    class_names: Sequence[str] | None = None,
    merge_lora: bool = False,
) -> str:
    """The weights, with the data's side saved beside them as transformers reads it, so that
    `pipeline(..., model=export_dir)` runs on raw text or images: the tokenizer with the chat template
    the conversations were rendered with (`chat_template`, which may be the config's rather than the
    tokenizer's own), so that inference formats prompts as training did; or the evaluation image
    transform as an image processor and the class names as the model's labels.

    Under model.lora `state_dict` holds the trained tensors alone (the checkpoint's): the adapter is
    written from them, or merged into model.init_from's weights (`merge_lora`).

    Returns what was written, for the log."""
    export_dir.mkdir(parents=True, exist_ok=True)
    base = model_config.get("init_from")
    if model_config.get("lora") is None:
        family.export(state_dict, model_config, export_dir, class_names)
        written = "consolidated fp32 weights"
    elif merge_lora:
        merged = merged_model(base_model(family, model_config), model_config, state_dict)
        family.export(merged.state_dict(), model_config, export_dir, class_names)
        written = f"the LoRA adapter merged into the weights of {base} (fp32)"
    else:
        export_adapter(base_model(family, model_config, weights=False), model_config, state_dict, export_dir)
        written = f"the LoRA adapter (peft) for the base model {base}"
    if tokenizer is not None:
        tokenizer.save(export_dir)
    if chat_template is not None:
        from transformers.utils import CHAT_TEMPLATE_FILE

        # Where transformers' save_pretrained writes a tokenizer's template, and from_pretrained reads it.
        (export_dir / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    if image_transform is not None:
        image_transform.save_image_processor(export_dir)
    return written


def base_model(family: ModelFamily, model_config: Mapping[str, Any], weights: bool = True) -> nn.Module:
    """model.init_from's model without adapters: its weights in fp32 on the host, or (`weights`
    False) its names and shapes alone, on the meta device."""
    if weights:
        return family.build(model_config)
    section = {key: value for key, value in model_config.items() if key != "init_from"}
    with torch.device("meta"):
        return family.build(section)


def load_exported(family: ModelFamily, model_config: Mapping[str, Any], export_dir: Path) -> nn.Module:
    """The export as its user loads it, in eval mode: the model, or peft's adapter on model.init_from's."""
    if is_adapter_export(export_dir):
        return load_adapter(base_model(family, model_config), export_dir)
    return family.load_export(export_dir).eval()


def sample_text(model: nn.Module, tokenizer: Any, num_tokens: int, seed: int) -> str:
    """A short continuation from the exported model (`load_exported`), proving the export is usable
    on its own: the prompt, a newline, and what follows it."""
    prompt = tokenizer.encode("\n")
    return tokenizer.decode(prompt + _sampled(model, prompt, num_tokens, seed, stop=None))


def sample_reply(
    model: nn.Module, tokenizer: Any, prompt: Sequence[int], num_tokens: int, seed: int, stop: int | None
) -> str:
    """The model's reply to a chat prompt, `prompt` being the conversation so far rendered through the
    chat template with the assistant's turn opened (add_generation_prompt), as inference renders it:
    up to `num_tokens` tokens, ended early by the end-of-turn token `stop`."""
    return tokenizer.decode(_sampled(model, list(prompt), num_tokens, seed, stop))


def _sampled(model: nn.Module, prompt: list[int], num_tokens: int, seed: int, stop: int | None) -> list[int]:
    """Tokens drawn after `prompt`, nanoGPT-style (top 50), with the context cropped to the position
    table, so a sample may be longer than the model's context (transformers' `generate` would index
    past it)."""
    context = model.config.max_position_embeddings  # transformers' name for it in every config
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.tensor([prompt], dtype=torch.long)
    drawn: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = model(input_ids=tokens[:, -context:]).logits[:, -1, :]
            top = torch.topk(logits, k=min(50, logits.size(-1)))
            logits[logits < top.values[:, -1:]] = -float("inf")
            next_token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            if stop is not None and int(next_token) == stop:
                break
            drawn.append(int(next_token))
            tokens = torch.cat([tokens, next_token], dim=1)
    return drawn
