"""One entry per model family: everything the engine knows of it. Presets, schema and config checks,
the data it trains on, builder, loss, evaluation, export, parallel forms, FLOPs and the planner's
estimates.

A family is two modules: its spec (models/<family>_spec.py), what checking a config needs (presets,
schema, checks, architecture arithmetic, parallel plans), and its model module (models/<family>.py),
which builds, trains, exports and costs the model. An entry reads the spec when it is made and the
model module at the first call that needs it (`Deferred`), so `python -m engine validate` answers
without importing torch, faster than importing it would take.

Adding a family means writing those two modules, which expose the names `_family` reads, and adding
it to `FAMILIES`; nothing outside models/ names a family (tests/unit/test_registry.py greps for it).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from models import gpt_spec, llama_spec, resnet_spec
from parallelism.tensor_plan import TensorParallelPlan

if TYPE_CHECKING:
    import torch

    from models.costs import ActivationEstimate, PlanShape
    from models.parallelize import ParallelRequest

    Batch = Mapping[str, torch.Tensor]


class ComputeLoss(Protocol):
    """A family's training loss of one micro-batch: the mean over its targets, or with `divisor` their
    summed loss divided by it (engine/backends/token_mean.py)."""

    def __call__(self, model: torch.nn.Module, batch: Batch, divisor: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class PipelineForm:
    """A family as DeepSpeed pipeline layers.

    `layers` turns a built model into the layer list of a `PipelineModule`; `split_batch` makes a
    loader batch into (first stage's input, last stage's labels); `loss` and `eval_sums` (whose keys
    `eval_keys` names) run on the last stage's output. `block_type` is the class-name pattern that
    partition method "type" balances; `num_blocks` counts those blocks for an architecture.
    """

    layers: Callable[[torch.nn.Module], list]
    split_batch: Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    eval_sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    eval_keys: tuple[str, ...]
    block_type: str
    num_blocks: Callable[[Mapping[str, Any]], int]


@dataclass(frozen=True)
class ModelFamily:
    """What the engine needs from a model family.

    `compute_loss` and `eval_sums` receive the module itself or a wrapper that forwards calls to it
    (a DeepSpeed engine), so they only call the model and never reach into its attributes.
    `check_init_from` reads what `model.init_from` names without loading its weights, so a wrong
    one stops the run before any process group. `pretrained_fields(saved)`, for a family that starts
    from transformers checkpoints (None elsewhere), turns such a checkpoint's config.json into the
    model-section fields it decides (engine/config/pretrained.py), or raises ValueError saying why
    the family cannot build it.
    `tensor_parallel` is None for a family that cannot be split by layer; `shard_units` lists the
    repeating blocks: FSDP wraps them one by one, and `parallelize` compiles them so.
    `parallelize(model, request)`: the family's one step from the built model to the form the run
    trains (models/parallelize.py): activation checkpointing, adapters, tensor parallelism, compile
    and the data-parallel wrapping that `request` carries, in that order.
    `builds_partitioned`: `build` honours transformers' ZeRO-3 integration, so under ZeRO-3 each rank
    only ever holds its share of the weights (engine/parallel/zero3_init.py).
    `lora`: `model.lora` applies, peft adapting the model's linear layers (models/lora.py).
    `sequence_parallel`: `parallel.sequence_parallel_size` applies, DeepSpeed's Ulysses splitting the
    sequence across ranks and the attention by heads (engine/parallel/sequence.py); `attention_heads`
    names the model-section fields of its query heads and key/value heads (the same field where
    every head has its own keys and values), which the degree must split (engine/config/rules.py);
    `no_sequence_parallel`, where it does not apply, says why.
    `export(state_dict, section, out_dir, class_names)` writes what the model's own library loads;
    `class_names`, the data's names for its labels where it has them, are for image classifiers, and
    a family trained on tokens refuses any.

    Config: `model_schema` holds the JSON Schema of the model section's own keys (the schema adds
    those every family has); `config_issues(section, data, micro_batch)` yields (JSON path, message)
    pairs for what the schema cannot say (`micro_batch` None while "auto").
    Data: `data_types` are the `data.type` values it trains on; `samples` is what a sample of them
    holds for it ("tokens" or "images", as data.build_datasets takes it); `uses_vocabulary`: its
    `model.vocab_size` comes from the tokenizer.
    Throughput: `items_per_sample(data)` items (tokens, images) in one sample, reported as
    `throughput_key`; `flops_per_item(architecture, data)` model FLOPs to train on one item
    (models/costs.py), `architecture` with its vocabulary settled.
    Sizes the engine settles "auto" from: `hidden_size(architecture)` the model width (ZeRO-3's
    persistence threshold, as HF's Trainer sizes it), `context_length(architecture)` the longest sequence it takes
    (`data.seq_len`); None where the family has none.
    Planner: `plan_activations(shape)` estimates activations and the tensors stages and
    tensor-parallel layers send; `suggests_checkpointing`: `plan --suggest` tries
    `model.activation_checkpointing` on it.
    """

    name: str
    presets: Mapping[str, Mapping[str, Any]]
    model_schema: Mapping[str, Mapping[str, Any]]
    config_issues: Callable[[Mapping[str, Any], Mapping[str, Any], int | None], Iterator[tuple[str, str]]]
    data_types: tuple[str, ...]
    samples: str
    uses_vocabulary: bool
    items_per_sample: Callable[[Mapping[str, Any]], int]
    throughput_key: str
    flops_per_item: Callable[[Mapping[str, Any], Mapping[str, Any]], int]
    plan_activations: Callable[[PlanShape], ActivationEstimate]
    suggests_checkpointing: bool
    architecture: Callable[[Mapping[str, Any]], dict[str, Any]]
    hidden_size: Callable[[Mapping[str, Any]], int | None]
    context_length: Callable[[Mapping[str, Any]], int | None]
    build: Callable[[Mapping[str, Any]], torch.nn.Module]
    check_init_from: Callable[[Mapping[str, Any]], None]
    pretrained_fields: Callable[[Mapping[str, Any]], dict[str, Any]] | None
    compute_loss: ComputeLoss
    eval_sums: Callable[[torch.nn.Module, Batch], dict[str, torch.Tensor]]
    summarize_eval: Callable[[Mapping[str, float]], dict[str, float]]
    export: Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], Path, Sequence[str] | None], None]
    load_export: Callable[[Path], torch.nn.Module]
    pipeline: PipelineForm
    tensor_parallel: TensorParallelPlan | None
    shard_units: Callable[[torch.nn.Module], list[torch.nn.Module]]
    parallelize: Callable[[torch.nn.Module, ParallelRequest], Any]
    builds_partitioned: bool
    lora: bool = False
    sequence_parallel: bool = False
    attention_heads: tuple[str, str] | None = None
    no_sequence_parallel: str = (
        "Ulysses splits the attention of a transformers decoder by heads, and this family's data has no token sequence"
    )


@dataclass(frozen=True)
class Deferred:
    """Function `name` of module `module`, imported at its first call: a family's model module
    imports torch and its model code, which checking a config never calls."""

    module: str
    name: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _imported(self.module, self.name)(*args, **kwargs)


@functools.cache
def _imported(module: str, name: str) -> Callable[..., Any]:
    """Looked up once: `compute_loss` is called for every micro-batch."""
    return getattr(importlib.import_module(module), name)


def _family(name: str, spec: ModuleType, model_module: str) -> ModelFamily:
    """Every family's spec and model module expose the same names, so registering one takes a single line."""

    def model(function: str) -> Deferred:
        return Deferred(model_module, function)

    return ModelFamily(
        name=name,
        presets=MappingProxyType(spec.PRESETS),
        model_schema=MappingProxyType(spec.MODEL_SCHEMA),
        config_issues=spec.config_issues,
        data_types=spec.DATA_TYPES,
        samples=spec.SAMPLES,
        uses_vocabulary=spec.USES_VOCABULARY,
        items_per_sample=spec.items_per_sample,
        throughput_key=spec.THROUGHPUT_KEY,
        flops_per_item=model("flops_per_item"),
        plan_activations=model("plan_activations"),
        suggests_checkpointing=spec.SUGGESTS_CHECKPOINTING,
        architecture=spec.architecture,
        hidden_size=spec.hidden_size,
        context_length=spec.context_length,
        build=model("build"),
        check_init_from=model("check_init_from"),
        pretrained_fields=getattr(spec, "pretrained_fields", None),
        compute_loss=model("compute_loss"),
        eval_sums=model("eval_sums"),
        summarize_eval=model("summarize_eval"),
        export=model("export"),
        load_export=model("load_export"),
        pipeline=PipelineForm(
            layers=model("pipeline_layers"),
            split_batch=model("pipeline_batch"),
            loss=model("pipeline_loss"),
            eval_sums=model("pipeline_eval_sums"),
            eval_keys=spec.EVAL_SUMS,
            block_type=spec.PIPELINE_BLOCK_TYPE,
            num_blocks=spec.pipeline_blocks,
        ),
        tensor_parallel=getattr(spec, "TENSOR_PARALLEL_PLAN", None),
        shard_units=model("shard_units"),
        parallelize=model("parallelize"),
        builds_partitioned=spec.BUILDS_PARTITIONED,
        lora=getattr(spec, "LORA", False),
        sequence_parallel=getattr(spec, "SEQUENCE_PARALLEL", False),
        attention_heads=getattr(spec, "ATTENTION_HEADS", None),
        **({"no_sequence_parallel": spec.NO_SEQUENCE_PARALLEL} if hasattr(spec, "NO_SEQUENCE_PARALLEL") else {}),
    )


FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "gpt": _family("gpt", gpt_spec, "models.gpt"),
        "resnet": _family("resnet", resnet_spec, "models.resnet"),
        "llama": _family("llama", llama_spec, "models.llama"),
    }
)


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise ValueError(f"model.family {name!r} is unknown; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]
