"""A decoder family as transformers checkpoints hold it: built fresh or from `model.init_from`,
checked against the configured shape, exported and loaded back.

transformers is imported inside the functions: config validation reads the family modules without
building a model and would otherwise spend most of its time importing it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.module_state import check_state_dict


@dataclass(frozen=True)
class HFCheckpoint:
    """A decoder family as transformers checkpoints hold it, and the family functions that follow
    from that: `build`, `check_init_from`, `export` and `load_export`.

    `model_class` names the transformers class (imported only when a model is built), `kind` the
    architecture in messages, `config` makes the transformers config of a model section. A
    `model.init_from` checkpoint must match that config in `fields` (model-section keys) and `fixed`
    (what the family always builds the same way). A tied embedding is stored once, under
    `embedding`, never also under `head`, as HF's own checkpoints hold it.
    """

    model_class: str
    kind: str
    config: Callable[[Mapping[str, Any]], Any]
    fields: tuple[str, ...]
    fixed: tuple[str, ...]
    embedding: str
    head: str = "lm_head.weight"

    def transformers_class(self) -> type:
        import transformers

        return getattr(transformers, self.model_class)

    def build(self, section: Mapping[str, Any]) -> torch.nn.Module:
        """A training-mode model: fresh weights (`initialised_model`; the caller seeds the RNG, so
        every rank draws the same), or those of `model.init_from`, refused up front when it is not a
        checkpoint of this shape (transformers would load it anyway, leave what is missing freshly
        initialised and only log that it did)."""
        config, init_from = self.config(section), section.get("init_from")
        if init_from is None:
            model = initialised_model(self.transformers_class(), config)
        else:
            self._check(Path(init_from), config)
            model = load_pretrained(self.transformers_class(), Path(init_from), config)
        # The loss `compute_loss` has the model compute; GPT2LMHeadModel's class name names none, and
        # transformers would warn before falling back to this same one.
        model.loss_type = "ForCausalLM"
        return model

    def check_init_from(self, section: Mapping[str, Any]) -> None:
        """Refuse a `model.init_from` that is no checkpoint of the configured shape. Reads its config
        only, no weights, so it runs before any process group starts."""
        if section.get("init_from") is not None:
            self._check(Path(section["init_from"]), self.config(section))

    def _check(self, path: Path, config: Any) -> None:
        from transformers import AutoConfig

        try:
            saved = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"model.init_from {path} is not a transformers checkpoint ({reason})") from None
        if not isinstance(saved, type(config)):
            raise ValueError(f"model.init_from {path} holds a {saved.model_type!r} checkpoint, not a {self.kind} one")

        def differences(names: tuple[str, ...]) -> str:
            return ", ".join(
                f"{name} {getattr(saved, name, None)} (configured: {getattr(config, name)})"
                for name in names
                if getattr(saved, name, None) != getattr(config, name)
            )

        configurable, fixed = differences(self.fields), differences(self.fixed)
        problems = (
            [f"{configurable}; set these fields in the model section to match the checkpoint"] if configurable else []
        )
        problems += [f"{fixed}, which this family does not configure"] if fixed else []
        if problems:
            raise ValueError(f"model.init_from {path} has a different architecture: {'; '.join(problems)}")

    def export(
        self,
        state_dict: Mapping[str, torch.Tensor],
        section: Mapping[str, Any],
        out_dir: Path,
        class_names: Sequence[str] | None = None,
    ) -> None:
        """An HF checkpoint directory (config.json, model.safetensors) that plain `from_pretrained`
        of the family's class loads, holding exactly the weights in `state_dict`. `class_names` is
        in every family's signature for classifiers; a language model has none to record."""
        if class_names is not None:
            raise ValueError(f"a {self.kind} model has no classes, yet was given {len(class_names)} class names")
        config = self.config(section)
        # Only the config and the parameter names of this model are used; the weights are `state_dict`.
        with torch.device("meta"):
            model = self.transformers_class()(config)
        expected = model.state_dict()
        weights = dict(state_dict)
        if config.tie_word_embeddings:
            weights = _one_embedding_key(weights, self.embedding, self.head)
            expected = {key: value for key, value in expected.items() if key != self.head}
        check_state_dict(expected, weights)
        model.save_pretrained(out_dir, state_dict=weights)

    def load_export(self, path: Path) -> torch.nn.Module:
        """The exported model, in eval mode as `from_pretrained` returns it."""
        return self.transformers_class().from_pretrained(path, local_files_only=True)


def initialised_model(model_class: type, config: Any) -> torch.nn.Module:
    """Fresh weights, drawn only after construction, module by module in `initialize_weights`' order.

    That is the order transformers draws them in when it builds the model partitioned under ZeRO-3
    (`deepspeed.zero.Init`, then `initialize_weights_zero3`), while a plain constructor would first
    spend the RNG on torch's default initialisation: drawn this way, a ZeRO-3 run starts from the same
    weights as every other layout.
    """
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        return AutoModelForCausalLM.from_config(config).train()
    with no_init_weights():
        model = model_class(config)
    model.initialize_weights()
    model.tie_weights()
    return model


def load_pretrained(model_class: type, path: Path, config: Any) -> torch.nn.Module:
    """Weights from a local HF checkpoint (already checked against `config`), built with `config`'s
    dropout and attention kernel. transformers would load a checkpoint lacking weights anyway, leave
    them freshly initialised and only log that it did; this refuses it."""
    model, loading_info = model_class.from_pretrained(
        path, config=config, dtype=torch.float32, local_files_only=True, output_loading_info=True
    )
    absent = sorted(loading_info["missing_keys"]) + sorted(map(str, loading_info["mismatched_keys"]))
    if absent:
        raise ValueError(f"model.init_from {path} lacks weights the model needs: {', '.join(absent[:5])}")
    return model.train()


def _one_embedding_key(weights: dict[str, torch.Tensor], embedding: str, head: str) -> dict[str, torch.Tensor]:
    """Consolidated checkpoints name a tied tensor under either key or both: keep `embedding` only."""
    tied = weights.pop(head, None)
    if tied is None:
        return weights
    kept = weights.setdefault(embedding, tied)
    if kept is not tied and not torch.equal(kept, tied):
        raise ValueError(f"{embedding} and {head} differ, but the model ties them into one tensor")
    return weights
