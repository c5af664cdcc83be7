"""Typed, frozen views of the engine's own sections (`model`, `data`, `trainer`, `parallel`), built
once from a validated, resolved document: code outside engine/config/ reads attributes a type
checker knows, never string keys. The DeepSpeed keys stay a dict: `deepspeed.initialize` takes one.

The fields mirror the schema (engine/config/schema.py) one for one; tests/unit/test_sections.py
compares them, and `typed_section` refuses a section whose keys differ."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from models.activation_checkpointing import Checkpointing

Section = TypeVar("Section")


def typed_section(cls: type[Section], values: Mapping[str, Any]) -> Section:
    """`cls` (a section dataclass) from a resolved section; refused where their keys differ."""
    names = {field.name for field in dataclasses.fields(cls)}
    if set(values) != names:
        raise ValueError(
            f"{cls.__name__} and the resolved section differ: missing {sorted(names - set(values))}, "
            f"unknown {sorted(set(values) - names)}"
        )
    return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in values.items()})


@dataclass(frozen=True)
class ModelSection:
    """The family and preset, the keys every family has, and `fields`: the whole section, which the
    family's builder reads (its architecture keys are the family's own: models/<family>.py)."""

    family: str
    preset: str | None  # None where model.init_from's config.json decided the architecture
    activation_checkpointing: Checkpointing
    init_from: str | None
    fields: Mapping[str, Any]

    @classmethod
    def from_document(cls, section: Mapping[str, Any]) -> ModelSection:
        return cls(
            family=section["family"],
            preset=section.get("preset"),
            activation_checkpointing=Checkpointing.of(section["activation_checkpointing"]),
            init_from=section["init_from"],
            fields=MappingProxyType(dict(section)),
        )

    @property
    def label(self) -> str:
        """How logs name the model: by the directory it starts from, which decides a GPT's or a
        Llama's architecture whatever the preset, or by its preset."""
        return f"{self.family} from {self.init_from}" if self.init_from is not None else f"{self.family} {self.preset}"

    @property
    def vocab_size(self) -> int | str | None:
        """The vocabulary rows of a family that has a vocabulary ("auto" until the tokenizer settles it)."""
        return self.fields.get("vocab_size")

    @property
    def num_classes(self) -> int | None:
        return self.fields.get("num_classes")

    @property
    def tiled_mlp(self) -> bool:
        """Whether each block's MLP runs as DeepSpeed's TiledMLP (a decoder family's key)."""
        return bool(self.fields.get("tiled_mlp", False))

    @property
    def loss(self) -> str:
        """How a decoder computes its loss: "auto", "full" logits, "tiled" or "fused" (models/tiling.py)."""
        return self.fields.get("loss", "auto")


@dataclass(frozen=True)
class DataSection:
    type: str
    path: str | tuple[str, ...] | None
    tokenizer: str
    weights: tuple[float, ...] | None
    dtype: str | None
    validation_path: str | None
    cache_dir: str
    cache_timeout_s: float
    streaming: bool
    text_field: str
    seq_len: int | None
    stride: int | None
    validation_fraction: float
    image_size: int
    augment: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_samples: int
    num_workers: int
    pin_memory: bool
    chat_template: str | None
    train_on: str
    packing: bool
    excess_length_strategy: str
    prompt_field: str
    completion_field: str

    def as_mapping(self) -> dict[str, Any]:
        """The section as the data package reads it (data/ never imports the engine)."""
        return {
            key: list(value) if isinstance(value, tuple) else value for key, value in dataclasses.asdict(self).items()
        }


@dataclass(frozen=True)
class TrainerSection:
    max_steps: int
    log_interval: int
    eval_interval: int
    eval_batches: int
    save_interval: int
    keep_checkpoints: int
    async_save: bool
    resume: bool | str
    output_dir: str
    progress_bar: bool
    backend: str
    seed: int
    nonfinite: str
    max_skipped_steps: int
    export: bool
    export_merge_lora: bool
    sample_tokens: int
    plots: bool
    peak_tflops: float | None
    comm_timeout_s: float
    compile: bool
    single_rank_fast_path: bool
    weight_decay_on: str
    threads_per_rank: int
    save_on_signal: bool
    signals: list[str]
    signal_grace_s: float
    max_wall_time: str | None

    @property
    def output_path(self) -> Path:
        """Where the run writes: logs, metrics, checkpoints, the export."""
        return Path(self.output_dir)


@dataclass(frozen=True)
class ParallelSection:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    pipeline_partition_method: str
    pipeline_activation_checkpoint_interval: int
    sequence_parallel_size: int
