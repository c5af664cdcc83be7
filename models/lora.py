"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the decoder families, through peft, the field's
own implementation: `get_peft_model` puts the adapters into the transformers model, and what trains,
checkpoints and exports is what peft itself would save and load.

The backends are handed the transformers model itself with the adapters in place (peft's
`get_base_model`), not peft's wrapper: every family function (FSDP units, activation checkpointing,
the loss) keeps the model's own class and names, and a parameter is named as in the base checkpoint,
with `lora_A.default.weight` and the like added. The wrapper is built again, on the meta device,
wherever peft's own names are needed (the exported adapter).

peft and torch are imported inside the functions: config validation reads this module's schema without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel
    from torch import nn

ALL_LINEAR = "all-linear"
# peft's own prefix of the wrapped model's names in a PeftModel's state dict.
PEFT_PREFIX = "base_model.model."
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

LORA_SCHEMA: Mapping[str, Any] = {
    "type": ["object", "null"],
    "description": "LoRA adapters through peft (GPT and Llama families): the base weights of model.init_from stay "
    "frozen (no gradients, no optimizer states), only the adapters and modules_to_save train, checkpoints hold "
    "those alone, and the export is a peft adapter directory on that base (the merged model with "
    "trainer.export_merge_lora). null: every weight trains.",
    "default": None,
    "properties": {
        "r": {"type": "integer", "minimum": 1, "default": 8, "description": "Rank of each adapter."},
        "alpha": {
            "type": "number",
            "exclusiveMinimum": 0,
            "default": 16,
            "description": "Scale numerator: an adapter's update is multiplied by alpha / r (peft's lora_alpha).",
        },
        "dropout": {
            "type": "number",
            "minimum": 0,
            "exclusiveMaximum": 1,
            "default": 0.0,
            "description": "Dropout on each adapter's input (peft's lora_dropout).",
        },
        "target_modules": {
            "anyOf": [
                {"const": ALL_LINEAR},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            ],
            "default": ALL_LINEAR,
            "description": 'Modules given adapters: names that module names end with (e.g. ["q_proj", "v_proj"]), '
            'each naming some linear layer or embedding of the model; "all-linear": every linear layer but the '
            "output head, as peft picks them.",
        },
        "modules_to_save": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "default": [],
            "description": "Modules trained whole beside the adapters (peft keeps a trained copy of each, saved "
            'with the adapter), e.g. ["lm_head"].',
        },
    },
    "additionalProperties": False,
}


def lora_config(section: Mapping[str, Any]) -> LoraConfig:
    """peft's LoraConfig of a `model.lora` section (schema defaults filled in)."""
    from peft import LoraConfig

    targets = section["target_modules"]
    return LoraConfig(
        r=section["r"],
        lora_alpha=section["alpha"],
        lora_dropout=section["dropout"],
        target_modules=targets if targets == ALL_LINEAR else list(targets),
        modules_to_save=list(section["modules_to_save"]) or None,
        task_type="CAUSAL_LM",
    )


def peft_model(model: nn.Module, section: Mapping[str, Any], seed: int) -> PeftModel:
    """peft's wrapper around `model`, its adapters drawn from `seed` alone: in a generator of their
    own, so they are the same on every rank and in every layout, whatever building the base drew
    (a ZeRO-3 build may draw on rank 0 alone), and the global generator goes on as if they were not drawn."""
    import torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lora_config(section))


def apply_lora(model: nn.Module, section: Mapping[str, Any], seed: int) -> nn.Module:
    """`model` with adapters in place and every other weight frozen, as its own class (see the module
    docstring)."""
    return peft_model(model, section, seed).get_base_model()


# What peft's LoRA adapts of a transformers model: linear layers (GPT-2's as transformers' Conv1D) and embeddings.
def _adaptable(module: nn.Module) -> bool:
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, Conv1D, nn.Embedding))


def adaptable_names(model: nn.Module) -> list[str]:
    """The distinct last parts of the names of the layers peft's LoRA can adapt, for messages: e.g.
    embed_tokens, q_proj, v_proj, lm_head."""
    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules() if _adaptable(module)]
    return list(dict.fromkeys(names))


def target_problems(model: nn.Module, section: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, problem) for each name in `target_modules` and `modules_to_save` that matches no module of
    `model` (the base, built on the meta device), as peft matches a list of names: a module whose name
    is it or ends with "." + it. peft itself refuses only a list none of which matches; a misspelt
    name beside a right one would train silently without its adapters."""
    adaptable = [name for name, module in model.named_modules() if _adaptable(module)]
    every = [name for name, _ in model.named_modules() if name]
    available = ", ".join(adaptable_names(model))
    problems = []
    targets = section["target_modules"]
    for index, target in enumerate([] if targets == ALL_LINEAR else targets):
        key = f"target_modules[{index}]"
        if not _matches(target, every):
            problems.append((key, f"{target!r} matches no module of the model; the layers LoRA adapts: {available}"))
        elif not _matches(target, adaptable):
            problems.append((key, f"{target!r} names no layer LoRA adapts (linear layers, embeddings): {available}"))
    # Any module trains whole: named by the last parts of the model's module names, less list indices.
    modules = ", ".join(dict.fromkeys(name.rsplit(".", 1)[-1] for name in every if not name[-1].isdigit()))
    for index, name in enumerate(section["modules_to_save"]):
        if not _matches(name, every):
            problems.append((f"modules_to_save[{index}]", f"{name!r} matches no module of the model: {modules}"))
    return problems


def _matches(target: str, names: list[str]) -> bool:
    return any(name == target or name.endswith("." + target) for name in names)


def export_adapter(
    base: nn.Module, section: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor], out_dir: Path
) -> None:
    """peft's adapter directory (adapter_config.json, adapter_model.safetensors) of the trained weights in
    `state_dict` (the run's names: the base's, adapters added), written by peft's `save_pretrained` from a
    wrapper around `base` (the base built on the meta device: only its names and shapes are read), so
    that `PeftModel.from_pretrained(<model.init_from's model>, out_dir)` loads it. The config records
    model.init_from, made absolute, as its base_model_name_or_path: `AutoPeftModelForCausalLM` loads
    the base from there wherever the export is read from (a relative path would be looked up on the Hub)."""
    wrapper = peft_model(base, section["lora"], seed=0)
    wrapper.peft_config["default"].base_model_name_or_path = str(Path(section["init_from"]).resolve())
    state = {PEFT_PREFIX + name: tensor for name, tensor in state_dict.items()}
    _check_adapter_state(wrapper, state)
    # save_embedding_layers False: "auto" would look the base up on the Hub to compare vocabularies,
    # and the engine never resizes them; embeddings in modules_to_save are saved as such.
    wrapper.save_pretrained(str(out_dir), state_dict=state, save_embedding_layers=False)


def _check_adapter_state(wrapper: PeftModel, state: Mapping[str, torch.Tensor]) -> None:
    """Refuse a state dict that lacks a trained tensor of the wrapper, or holds one of another shape:
    peft would save what is there and the adapter would load partly at its initial values."""
    expected = {name: p.shape for name, p in wrapper.named_parameters() if p.requires_grad}
    missing = sorted(set(expected) - set(state))
    wrong = sorted(name for name in set(expected) & set(state) if state[name].shape != expected[name])
    problems = [(label, names) for label, names in (("missing", missing), ("wrong shape", wrong)) if names]
    if problems:
        listed = "; ".join(f"{label}: {', '.join(names[:5])}" for label, names in problems)
        raise ValueError(f"the checkpoint's adapter does not match model.lora: {listed}")


def merged_model(base: nn.Module, section: Mapping[str, Any], state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """`base` (model.init_from's weights, loaded whole) with the trained adapters of `state_dict` merged
    into its weights by peft's `merge_and_unload`: a plain transformers model again, which
    `AutoModelForCausalLM.from_pretrained` loads once saved."""
    wrapper = peft_model(base, section["lora"], seed=0)
    state = {PEFT_PREFIX + name: tensor for name, tensor in state_dict.items()}
    _check_adapter_state(wrapper, state)
    trained = {name for name, p in wrapper.named_parameters() if p.requires_grad}
    wrapper.load_state_dict({name: state[name] for name in trained}, strict=False)
    return wrapper.merge_and_unload()


def load_adapter(base: nn.Module, adapter_dir: Path) -> nn.Module:
    """The exported adapter on `base` (model.init_from's model), as a user loads it, in eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def is_adapter_export(export_dir: Path) -> bool:
    return all((export_dir / name).is_file() for name in ADAPTER_FILES)
