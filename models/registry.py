"""One entry per model family: its presets, builder, loss, evaluation and export.

Adding a family means writing one module that exposes the names `_family` reads, and adding it
to `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import Any

import torch

from models import gpt, resnet


@dataclass(frozen=True)
class ModelFamily:
    """What the engine needs from a model family.

    `compute_loss` and `eval_sums` receive the module itself or a wrapper that forwards calls to it
    (a DeepSpeed engine), so they only call the model and never reach into its attributes.
    """

    name: str
    presets: Mapping[str, Mapping[str, Any]]
    architecture: Callable[[Mapping[str, Any]], dict[str, Any]]
    build: Callable[[Mapping[str, Any]], torch.nn.Module]
    compute_loss: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor]
    eval_sums: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]
    summarize_eval: Callable[[Mapping[str, float]], dict[str, float]]
    export: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], Path], None]
    load_export: Callable[[Path], torch.nn.Module]


def _family(name: str, module: ModuleType) -> ModelFamily:
    """Every family module exposes the same names, so registering one takes a single line."""
    return ModelFamily(
        name=name,
        presets=MappingProxyType(module.PRESETS),
        architecture=module.architecture,
        build=module.build,
        compute_loss=module.compute_loss,
        eval_sums=module.eval_sums,
        summarize_eval=module.summarize_eval,
        export=module.export,
        load_export=module.load_export,
    )


FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {"gpt": _family("gpt", gpt), "resnet": _family("resnet", resnet)}
)


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"model.family {name!r} is unknown; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]
