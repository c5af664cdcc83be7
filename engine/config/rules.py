"""Cross-field rules: everything the schema cannot say about one key alone.

Each rule reads a schema-valid document with defaults filled in and yields the problems it
finds, each naming the JSON path to change and how to change it. Together they catch, before
any process starts, what DeepSpeed would otherwise assert at run time (or silently accept).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from data.kinds import KINDS, get_kind, kind_schema
from engine.config.batch import BatchError, solve_document_batch
from engine.config.errors import ConfigIssue
from engine.config.schema import AUTO
from engine.config.stop_settings import parse_duration, signal_number
from engine.config.support import unsupported_issues
from engine.launch.detect import effective_backend
from engine.launch.hardware import Hardware
from models import FAMILIES, get_family
from models.kernels import LIGER, liger_installed

Rule = Callable[[dict, int, "Hardware | None"], Iterator[ConfigIssue]]

# What zero_optimization.stage means under the accelerate backend (stage 1 has no FSDP equivalent).
ACCELERATE_WRAPPERS = {0: "ddp", 2: "fsdp_grad_op", 3: "fsdp_full"}


def _known(value: Any) -> Any:
    return None if value == AUTO else value


def _split_ranks(parallel: Mapping[str, Any]) -> int:
    """The ranks that share one data-parallel replica: its tensor shards, stages and sequence shards."""
    return parallel["tensor_parallel_size"] * parallel["pipeline_parallel_size"] * parallel["sequence_parallel_size"]


def data_parallel_size(document: dict, world_size: int) -> int:
    """Replicas that read different batches: world size / (tensor x pipeline x sequence)."""
    return world_size // _split_ranks(document["parallel"])


def check_parallel_layout(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    parallel = document["parallel"]
    split = _split_ranks(parallel)
    factors = ["tensor_parallel_size", "pipeline_parallel_size"]
    factors += ["sequence_parallel_size"] if parallel["sequence_parallel_size"] > 1 else []
    if world_size % split:
        yield ConfigIssue(
            "parallel",
            f"world size {world_size} is not divisible by {' x '.join(factors)} = {split}; launch a multiple of "
            f"{split} processes",
        )


def offloads(zero: dict) -> bool:
    """Whether a `zero_optimization` section moves parameters or optimizer states to the host or NVMe."""
    return zero["offload_param"]["device"] != "none" or zero["offload_optimizer"]["device"] != "none"


def exempts_vectors(section: dict[str, Any], scope: str) -> bool:
    """Whether the optimizer puts the biases and gains in a group of their own
    (engine/backends/optim.py `parameter_groups`): only when there is decay to exempt them from."""
    return scope == "matrices" and bool(section["params"].get("weight_decay", 0.0))


def auto_bf16(document: dict, hardware: Hardware) -> bool:
    """What bf16.enabled "auto" resolves to: bf16 on a CUDA device that has it, unless torch_autocast
    is the mixed precision asked for."""
    return not document["torch_autocast"]["enabled"] and hardware.device_type == "cuda" and hardware.bf16_supported


def auto_fp16(document: dict, hardware: Hardware, bf16: bool) -> bool:
    """What fp16.enabled "auto" resolves to: fp16 on a CUDA device that has it, where bf16 (`bf16`, as
    resolved) and torch_autocast are off."""
    autocast = document["torch_autocast"]["enabled"] is True
    return not autocast and not bf16 and hardware.device_type == "cuda" and hardware.fp16_supported


def auto_torch_adam(document: dict) -> bool:
    """What optimizer.params.torch_adam "auto" resolves to: torch's Adam, which needs no compiler, wherever
    DeepSpeed would build its FusedAdam; DeepSpeed's own Adam under optimizer offload (its C++ CPU Adam is
    the fast host optimizer), with legacy_fusion, which only FusedAdam's fp16 wrapper reads, and with
    bias_correction false, which torch's Adam has no switch for."""
    offloaded = document["zero_optimization"]["offload_optimizer"]["device"] != "none"
    uncorrected = document["optimizer"]["params"].get("bias_correction") is False
    return not offloaded and not document["optimizer"].get("legacy_fusion") and not uncorrected


def labels_can_be_masked(data: Mapping[str, Any]) -> bool:
    """Whether the training labels of data section `data` can hold IGNORE_INDEX (prompts, other roles'
    turns, padding), so that micro-batches differ in their counts of targets
    (engine/backends/token_mean.py): its data kind says (data/kinds/)."""
    return get_kind(data["type"]).masks_labels


def check_pipeline(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """What DeepSpeed's PipelineEngine cannot do, refused before it asserts at run time."""
    parallel, model = document["parallel"], document["model"]
    stages = parallel["pipeline_parallel_size"]
    interval = parallel["pipeline_activation_checkpoint_interval"]
    if stages == 1:
        if interval:
            yield ConfigIssue(
                "parallel.pipeline_activation_checkpoint_interval",
                f"{interval} applies to pipeline stages only; set it to 0 and use model.activation_checkpointing",
            )
        return
    stage = document["zero_optimization"]["stage"]
    if stage >= 2:
        yield ConfigIssue(
            "zero_optimization.stage",
            f"ZeRO-{stage} cannot run with pipeline parallelism (DeepSpeed's pipeline engine reduces gradients "
            "itself); use stage 0 or 1, or set parallel.pipeline_parallel_size to 1",
        )
    bf16 = document["bf16"]["enabled"]
    if bf16 == AUTO and hardware is not None:
        bf16 = auto_bf16(document, hardware)
    if stage == 0 and bf16 is True:
        yield ConfigIssue(
            "zero_optimization.stage",
            "ZeRO-0 with bf16 under pipeline parallelism trains, but DeepSpeed's BF16_Optimizer cannot load the "
            "checkpoints it writes (KeyError in _load_legacy_checkpoint); use stage 1, which resumes, and whose "
            "optimizer states on one data-parallel replica are the same",
        )
    fp16 = document["fp16"]["enabled"]
    if fp16 == AUTO and hardware is not None:
        fp16 = auto_fp16(document, hardware, bf16 is True)
    if stage == 0 and fp16 is True:
        yield ConfigIssue(
            "zero_optimization.stage",
            "ZeRO-0 with fp16 under pipeline parallelism would not scale the loss: DeepSpeed's pipeline engine "
            "backpropagates the last stage's loss unscaled, then its FP16_Optimizer divides the gradients by the "
            "loss scale; use stage 1, whose ZeRO optimizer scales it",
        )
    if model["activation_checkpointing"]:
        yield ConfigIssue(
            "model.activation_checkpointing",
            "pipeline stages checkpoint by layer interval; set it to false and "
            "parallel.pipeline_activation_checkpoint_interval to 1 (or more)",
        )
    if labels_can_be_masked(document["data"]):
        yield ConfigIssue(
            "data.type",
            f'"{document["data"]["type"]}" data cannot train under pipeline parallelism: DeepSpeed\'s pipeline '
            "engine averages each micro-batch's mean loss, not the global batch's target tokens, and its stages "
            "take one micro-batch shape and number positions 0..T-1 themselves, so padded micro-batches and packed "
            "conversations do not pass; set parallel.pipeline_parallel_size to 1 (ZeRO-3 or tensor parallelism "
            "splits the model instead)",
        )
    family = get_family(model["family"])
    blocks = family.pipeline.num_blocks(family.architecture(model))
    if stages > blocks:
        yield ConfigIssue(
            "parallel.pipeline_parallel_size",
            f"{stages} stages for a model of {blocks} {family.pipeline.block_type.split('|')[0]} blocks; "
            f"use at most {blocks} stages or a deeper model",
        )


def check_tensor_parallel(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    degree, model = document["parallel"]["tensor_parallel_size"], document["model"]
    if degree == 1:
        return
    family = get_family(model["family"])
    if family.tensor_parallel is None:
        yield ConfigIssue(
            "parallel.tensor_parallel_size",
            f"{family.name} models have no tensor-parallel form (convolutions split poorly); set it to 1 and use "
            "data or pipeline parallelism",
        )
        return
    stage = document["zero_optimization"]["stage"]
    if stage == 3:
        yield ConfigIssue(
            "zero_optimization.stage",
            "ZeRO-3 does not combine with tensor parallelism here; use stage 0, 1 or 2, or set "
            "parallel.tensor_parallel_size to 1",
        )
    architecture = family.architecture(model)
    for field, counted in family.tensor_parallel.divisible.items():
        if architecture[field] % degree:
            yield ConfigIssue(
                f"model.{field}",
                f"{architecture[field]} {counted} cannot be split across tensor_parallel_size {degree}; pick a "
                f"{field} divisible by {degree}",
            )
    vocab = architecture["vocab_size"]
    if vocab != AUTO and vocab % degree:
        yield ConfigIssue(
            "model.vocab_size",
            f"{vocab} rows cannot be split across tensor_parallel_size {degree}; use "
            f'{-(-vocab // degree) * degree} or "auto" (rounds the tokenizer\'s size up)',
        )


def check_sequence_parallel(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """What DeepSpeed's Ulysses (engine/parallel/sequence.py) cannot run, refused before any process
    group: inside its attention DeepSpeed would assert, or train another model than one process would."""
    parallel, model, data = document["parallel"], document["model"], document["data"]
    degree = parallel["sequence_parallel_size"]
    if degree == 1:
        return
    path = "parallel.sequence_parallel_size"
    family = get_family(model["family"])
    if not family.sequence_parallel:
        yield ConfigIssue(
            path, f"{family.name} models have no sequence-parallel form ({family.no_sequence_parallel}); set it to 1"
        )
        return
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if parallel[key] > 1:
            yield ConfigIssue(
                f"parallel.{key}",
                f"{parallel[key]} does not combine with sequence_parallel_size {degree}: DeepSpeed's Ulysses groups "
                "(parallel_state_sp) split the world into data x sequence ranks only; set it to 1 (ZeRO-3 "
                "partitions the model states over every rank instead)",
            )
    if effective_backend(document["trainer"]["backend"]) != "deepspeed":
        yield ConfigIssue(
            path,
            "sequence parallelism runs inside DeepSpeed's engine (its sequence-parallel groups, and ZeRO's gradient "
            'reduction over them); launch with deepspeed and trainer.backend "deepspeed", or set it to 1',
        )
    zero = document["zero_optimization"]
    if zero["stage"] == 3 and zero["reduce_scatter"] is False:
        yield ConfigIssue(
            "zero_optimization.reduce_scatter",
            "false under ZeRO-3 with sequence parallelism: DeepSpeed 0.19.8 averages ZeRO-3's gradients over the "
            "data-parallel ranks on its contiguous path but over data x sequence ranks on its reduce-scatter path, "
            "bucket by bucket, and the engine corrects the reduce-scatter one; set it to true",
        )
    if model.get("attn_implementation") == "eager":
        yield ConfigIssue(
            "model.attn_implementation",
            '"eager" attention needs the 4D mask DeepSpeed\'s Ulysses drops (it runs sdpa, flash and flex '
            'attention only); use "sdpa", which masks causally over the whole gathered sequence',
        )
    if data.get("packing"):
        yield ConfigIssue(
            "data.packing",
            "true under sequence parallelism: DeepSpeed's Ulysses drops the mask that keeps packed conversations "
            "apart, so each would attend to the ones before it in its sample; set it to false (every conversation "
            "is then padded to its micro-batch's longest, and on to a multiple of sequence_parallel_size)",
        )
    architecture = family.architecture(model)
    seq_len = data["seq_len"] if data["seq_len"] != AUTO else family.context_length(architecture)
    # Conversations are padded to a multiple of the degree; a fixed window would pad every sample.
    if not labels_can_be_masked(data) and seq_len % degree:
        nearest = " or ".join(str(n) for n in sorted({seq_len // degree * degree, -(-seq_len // degree) * degree}) if n)
        yield ConfigIssue(
            "data.seq_len",
            f"{seq_len} tokens do not split into {degree} equal slices (parallel.sequence_parallel_size), as "
            f"DeepSpeed's Ulysses needs; use a multiple of {degree} ({nearest})",
        )
    query, key_value = family.attention_heads
    heads, kv_heads = architecture[query], architecture[key_value]
    if heads % degree:
        yield ConfigIssue(
            f"model.{query}",
            f"{heads} attention heads cannot be split across sequence_parallel_size {degree}: inside attention each "
            f"rank of the group computes heads / {degree} of them over the whole sequence; use a degree that "
            f"divides {heads}",
        )
    if key_value != query and kv_heads % degree and degree % kv_heads:
        yield ConfigIssue(
            f"model.{key_value}",
            f"{kv_heads} key/value heads neither split across sequence_parallel_size {degree} nor divide it "
            "(DeepSpeed's Ulysses gives each rank kv / SP of them, or repeats each over SP / kv ranks); use a degree "
            f"that divides {kv_heads} or is a multiple of it",
        )


def check_tiling(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """ALST's tiled MLP and the loss without whole logits (model.tiled_mlp, model.loss "tiled" or
    "fused") where they cannot run."""
    model = document["model"]
    tiled = {"model.tiled_mlp": model.get("tiled_mlp", False), "model.loss": model.get("loss") in ("tiled", "fused")}
    if tiled["model.tiled_mlp"] and effective_backend(document["trainer"]["backend"]) != "deepspeed":
        yield ConfigIssue(
            "model.tiled_mlp",
            "DeepSpeed's tiled MLP runs several backward passes inside one, which DDP's and FSDP's gradient hooks do "
            "not allow (DeepSpeed's ZeRO is told by it when a gradient is whole); use trainer.backend "
            '"deepspeed", or turn it off',
        )
    if tiled["model.tiled_mlp"] and model.get("dropout", 0.0) > 0:
        yield ConfigIssue(
            "model.tiled_mlp",
            f"with model.dropout {model['dropout']}: DeepSpeed's tiled MLP computes each piece again in backward "
            "without the forward's random state, so its dropout masks would differ; set model.dropout to 0 or turn "
            "it off",
        )
    data = document["data"]
    if document["zero_optimization"]["stage"] == 3 and labels_can_be_masked(data) and not data.get("packing", False):
        for path, on in tiled.items():
            if on:
                yield ConfigIssue(
                    path,
                    "under ZeRO-3 with unpacked conversations: each micro-batch is padded to its own longest, so "
                    "the ranks would cut their sequences into different numbers of pieces, and ZeRO-3 gathers the "
                    "weights piece by piece in a collective every rank must join; pack the data (data.packing), "
                    "use ZeRO-1 or 2, or turn it off",
                )


def check_kernels(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """model.kernels "liger" where Liger's Triton kernels cannot run (models/kernels.py)."""
    if document["model"].get("kernels", "none") != LIGER:
        return
    if hardware is not None and hardware.device_type != "cuda":
        yield ConfigIssue(
            "model.kernels",
            '"liger" runs Triton kernels, which need a CUDA device, and this machine has none; set it to "none" '
            "(the same model, with transformers' own RMSNorm, SwiGLU and rotary embedding)",
        )
    elif not liger_installed():
        yield ConfigIssue(
            "model.kernels",
            '"liger" needs the liger-kernel package, which is not installed; `pip install liger-kernel`, or set it '
            'to "none"',
        )


def check_batch(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    try:
        solve_document_batch(document, max(1, data_parallel_size(document, world_size)))
    except BatchError as error:
        yield ConfigIssue(error.path, str(error))


def check_precision(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    fp16, bf16 = document["fp16"]["enabled"], document["bf16"]["enabled"]
    if fp16 is True and bf16 is True:
        yield ConfigIssue("fp16.enabled", "fp16 and bf16 are both enabled; enable at most one")
    if document["torch_autocast"]["enabled"]:
        yield from _autocast_issues(document, hardware)
    if hardware is None:
        return
    if fp16 is True and not hardware.fp16_supported:
        yield ConfigIssue("fp16.enabled", f"this {hardware.name} does not support fp16; use bf16 or fp32")
    if bf16 is True and not hardware.bf16_supported:
        yield ConfigIssue("bf16.enabled", f"this {hardware.name} does not support bf16; use fp16 or fp32")


def _autocast_issues(document: dict, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """torch_autocast where DeepSpeed applies it: its whole-model engine, whose `forward` autocasts.
    The pipeline engine calls its stages outside that `forward`."""
    path = "torch_autocast.enabled"
    for other in ("bf16", "fp16"):
        if document[other]["enabled"] is True:
            yield ConfigIssue(
                path,
                f"torch_autocast and {other}.enabled are both on; choose one: autocast keeps fp32 weights, "
                f"{other} trains {other} weights with an fp32 master",
            )
    if effective_backend(document["trainer"]["backend"]) != "deepspeed":
        yield ConfigIssue(
            path, "torch_autocast is a DeepSpeed section; on the accelerate backend bf16.enabled autocasts"
        )
    if document["parallel"]["pipeline_parallel_size"] > 1:
        yield ConfigIssue(path, "DeepSpeed's pipeline engine does not autocast its stages; use bf16.enabled")
    if hardware is not None and not hardware.bf16_supported:
        yield ConfigIssue(path, f"this {hardware.name} does not support bf16; use fp16 or fp32")
    for index, name in enumerate(document["torch_autocast"]["lower_precision_safe_modules"]):
        problem = _module_class_problem(name)
        if problem:
            yield ConfigIssue(f"torch_autocast.lower_precision_safe_modules.{index}", problem)


def _module_class_problem(name: str) -> str | None:
    """Why `name` ("package.Class") is not a torch module class DeepSpeed can import, or None.
    DeepSpeed imports these inside `deepspeed.initialize`, after every rank has started. torch only
    where the config names such classes: checking any other config needs none."""
    import torch

    package, _, class_name = name.rpartition(".")
    try:
        module = importlib.import_module(package) if package else None
    except (ImportError, TypeError):  # TypeError: a relative name such as "..", which has no anchor here
        module = None
    if module is None:
        return f"{name!r} is not package.Class of an importable module"
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        return f"{package} has no torch module class {class_name!r}"
    return None


def check_zero(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    zero = document["zero_optimization"]
    stage = zero["stage"]
    optimizer = document["optimizer"]
    if zero["offload_param"]["device"] != "none" and stage != 3:
        yield ConfigIssue(
            "zero_optimization.offload_param.device",
            f"parameter offload needs ZeRO stage 3 (stage is {stage}); set zero_optimization.stage to 3 "
            'or offload_param.device to "none"',
        )
    if zero["offload_optimizer"]["device"] != "none":
        if stage == 0:
            yield ConfigIssue(
                "zero_optimization.offload_optimizer.device",
                'optimizer offload needs ZeRO stage 1, 2 or 3; raise zero_optimization.stage or set "none"',
            )
        if optimizer["type"] not in ("Adam", "AdamW"):
            yield ConfigIssue(
                "optimizer.type",
                f"{optimizer['type']} cannot run under offload_optimizer (DeepSpeed's host optimizer is Adam); "
                "use Adam or AdamW",
            )
    if optimizer["type"] == "AdamW" and optimizer["params"].get("adam_w_mode") is False:
        yield ConfigIssue(
            "optimizer.params.adam_w_mode",
            'false asks for L2 decay, but type "AdamW" always decouples it (DeepSpeed ignores the flag there); '
            'use type "Adam" with adam_w_mode false, or drop the key',
        )
    deepspeed = effective_backend(document["trainer"]["backend"]) == "deepspeed"
    torch_adam = optimizer["params"].get("torch_adam")
    torch_adam = auto_torch_adam(document) if torch_adam == AUTO else torch_adam
    if deepspeed and optimizer["params"].get("fused") is True and torch_adam is False:
        yield ConfigIssue(
            "optimizer.params.fused",
            "true asks for torch's fused Adam, but torch_adam resolves to false, so DeepSpeed builds its own Adam "
            "(FusedAdam, or CPU Adam under optimizer offload), which has no such switch; set "
            "optimizer.params.torch_adam to true or drop fused",
        )
    if deepspeed and optimizer["params"].get("bias_correction") is False and torch_adam is True:
        yield ConfigIssue(
            "optimizer.params.bias_correction",
            "false needs DeepSpeed's own Adam (FusedAdam, or CPU Adam under optimizer offload), and torch_adam true "
            'hands the step to torch\'s Adam, which always corrects; set optimizer.params.torch_adam to "auto" or '
            "false, or drop bias_correction",
        )
    if deepspeed and optimizer["type"] == "SGD" and stage >= 1 and not document["zero_allow_untested_optimizer"]:
        yield ConfigIssue(
            "zero_allow_untested_optimizer",
            "DeepSpeed runs SGD under ZeRO only with zero_allow_untested_optimizer: true; set it or use Adam/AdamW",
        )


def check_scheduler(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    scheduler = document.get("scheduler")
    if not scheduler or "total_num_steps" not in scheduler["params"]:
        return
    total = scheduler["params"]["total_num_steps"]
    total = document["trainer"]["max_steps"] if total == AUTO else total
    warmup = scheduler["params"]["warmup_num_steps"]
    if warmup > total:
        yield ConfigIssue(
            "scheduler.params.warmup_num_steps",
            f"{warmup} warm-up steps exceed total_num_steps {total}; shorten the warm-up or lengthen the run",
        )
    max_steps = document["trainer"]["max_steps"]
    if scheduler["type"] == "WarmupDecayLR" and total < max_steps:
        # WarmupCosineLR holds its floor (cos_min_ratio) after the total; WarmupDecayLR's floor is 0.
        yield ConfigIssue(
            "scheduler.params.total_num_steps",
            f"WarmupDecayLR reaches lr 0 at step {total}, so the last {max_steps - total} of trainer.max_steps "
            f'{max_steps} would train nothing; set it to "auto" (the run\'s max_steps) or at least {max_steps}',
        )


def check_model(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    model, data = document["model"], document["data"]
    micro_batch = _known(document.get("train_micro_batch_size_per_gpu"))
    for path, message in get_family(model["family"]).config_issues(model, data, micro_batch):
        yield ConfigIssue(path, message)
    # A transformers checkpoint's directory is read, and a missing one refused, by engine/config/pretrained.py.
    pretrained = get_family(model["family"]).pretrained_fields is not None
    if model["init_from"] is not None and not pretrained and not os.path.exists(model["init_from"]):
        yield ConfigIssue("model.init_from", f"{model['init_from']!r} does not exist")


def check_lora(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """What model.lora's adapters combine with here. Its target modules are checked against the
    model's own, built on the meta device, in `engine.preflight.check_lora_targets`."""
    model, parallel = document["model"], document["parallel"]
    if model.get("lora") is None:
        if document["trainer"]["export_merge_lora"]:
            yield ConfigIssue(
                "trainer.export_merge_lora",
                "true merges model.lora's adapters, and model.lora is null; set it to false",
            )
        return
    family = get_family(model["family"])
    if not family.lora:
        adapted = ", ".join(name for name, entry in FAMILIES.items() if entry.lora)
        yield ConfigIssue(
            "model.lora",
            f"{family.name} models have no LoRA form here (peft adapts the linear layers of decoders; the families "
            f"with one: {adapted}); remove model.lora",
        )
        return
    if model["init_from"] is None:
        yield ConfigIssue(
            "model.init_from",
            "model.lora trains adapters on a pretrained base: set it to the base model's directory, whose weights "
            "stay frozen, are read again at every resume (checkpoints hold the adapters alone) and are what the "
            "exported adapter loads on",
        )
    if parallel["tensor_parallel_size"] > 1:
        yield ConfigIssue(
            "parallel.tensor_parallel_size",
            "LoRA does not combine with tensor parallelism here: the tensor-parallel plan cuts the projections into "
            "column and row shards that peft's adapters, wrapped around them, do not know of (an adapter beside a "
            "shard would need a split and an all-reduce of its own). Set it to 1; ZeRO-3 spreads the frozen base "
            "over every rank instead",
        )
    if parallel["pipeline_parallel_size"] > 1:
        yield ConfigIssue(
            "parallel.pipeline_parallel_size",
            "LoRA does not combine with pipeline parallelism here: DeepSpeed's pipeline engine saves every layer "
            "whole, the frozen base with it, and its stages are untested with frozen weights. Set it to 1; "
            "ZeRO-3 spreads the frozen base over every rank instead",
        )


def check_data(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """What the data section asks, checked by its kind's registry entry (data/kinds/)."""
    data, family = document["data"], get_family(document["model"]["family"])
    kind = get_kind(data["type"])
    if data["type"] not in family.data_types:
        allowed = " or ".join(f'"{name}"' for name in family.data_types)
        yield ConfigIssue("data.type", f'"{data["type"]}" data cannot train a {family.name} model; use {allowed}')
    if kind.path_needed is not None and data["path"] is None:
        yield ConfigIssue("data.path", f"{data['type']} data needs a path ({kind.path_needed})")
    for key in ("path", "validation_path"):
        paths = data[key] if isinstance(data[key], list) else [data[key]]
        for index, path in enumerate(paths):
            if path is not None and not kind.path_exists(key, path, data):
                where = f"data.{key}" if not isinstance(data[key], list) else f"data.{key}[{index}]"
                yield ConfigIssue(where, f"{path!r} does not exist")
    tokenizer = data["tokenizer"]
    # model.init_from's own directory is refused there when missing (engine/config/pretrained.py), save
    # by `plan` before the download.
    pretrained = tokenizer == document["model"].get("init_from")
    if kind.reads_tokenizer and tokenizer not in ("char", "byte") and not pretrained and not os.path.isdir(tokenizer):
        yield ConfigIssue("data.tokenizer", f'{tokenizer!r} is neither "char", "byte" nor a tokenizer directory')
    vocab = family.architecture(document["model"]).get("vocab_size", AUTO) if family.uses_vocabulary else AUTO
    if kind.reads_tokenizer and tokenizer == "byte" and vocab != AUTO and vocab < 256:
        yield ConfigIssue(
            "model.vocab_size", f'{vocab} is smaller than the byte tokenizer\'s 256 tokens; use 256 or "auto"'
        )
    for path, message in kind.config_issues(data):
        yield ConfigIssue(path, message)
    yield from _keys_of_other_kinds(data, kind.name, kind.schema)


def _keys_of_other_kinds(data: dict, name: str, own: Mapping[str, Any]) -> Iterator[ConfigIssue]:
    """A key only other kinds read, set away from its default, would be silently ignored: refused."""
    for key, schema in kind_schema().items():
        if key not in own and data[key] != schema.get("default"):
            readers = " and ".join(f'"{kind.name}"' for kind in KINDS.values() if key in kind.schema)
            yield ConfigIssue(
                f"data.{key}", f'only data.type {readers} reads it, and data.type "{name}" would ignore it; remove it'
            )


def check_trainer(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    resume = document["trainer"]["resume"]
    if isinstance(resume, str) and not os.path.isdir(resume):
        yield ConfigIssue("trainer.resume", f"{resume!r} is not a checkpoint directory")
    if document["trainer"]["sample_tokens"] and not document["trainer"]["export"]:
        yield ConfigIssue(
            "trainer.sample_tokens",
            "the sample is drawn from the export, and trainer.export is false; set export to true or "
            "sample_tokens to 0",
        )
    output_dir = document["trainer"]["output_dir"]
    problem = _unwritable(Path("runs") if output_dir == AUTO else Path(output_dir))
    if problem:
        yield ConfigIssue("trainer.output_dir", problem)
    yield from _stop_issues(document["trainer"])


def _stop_issues(trainer: dict) -> Iterator[ConfigIssue]:
    """trainer.signals and trainer.max_wall_time: names and durations that mean something."""
    for index, name in enumerate(trainer["signals"]):
        try:
            signal_number(name)
        except ValueError as error:
            yield ConfigIssue(f"trainer.signals[{index}]", str(error))
    if trainer["max_wall_time"] is not None:
        try:
            parse_duration(trainer["max_wall_time"])
        except ValueError as error:
            yield ConfigIssue("trainer.max_wall_time", str(error))


def _unwritable(directory: Path) -> str | None:
    """Why the run could not make `directory` and write in it, judged from its nearest existing
    ancestor; None when it can. Checked here, as a failure there would come on every rank at once."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == directory else f", so {str(directory)!r} cannot be made"
        return f"{str(existing)!r} is a file{where}; the run needs a directory there"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == directory else f" (the nearest existing folder of {str(directory)!r})"
        return f"{str(existing)!r}{where} is not writable by this user"
    return None


def check_nonfinite(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """Under "skip" the optimizer must test gradients for NaN/inf and drop the update itself. Every
    DeepSpeed optimizer but one does (ZeRO 1-3, and the bf16/fp16 wrappers at ZeRO-0, all drop the update
    and hold the LR schedule); fp32 ZeRO-0 runs the bare torch optimizer, which writes NaN into the weights.
    The accelerate backend tests gradients itself. "auto" precision counts as fp32: it is fp32 on CPU."""
    if document["trainer"]["nonfinite"] != "skip" or effective_backend(document["trainer"]["backend"]) != "deepspeed":
        return
    mixed = document["fp16"]["enabled"] is True or document["bf16"]["enabled"] is True
    if document["bf16"]["enabled"] is not False and document["bf16"]["check_grad_overflow"] is False:
        yield ConfigIssue(
            "bf16.check_grad_overflow",
            "false lets DeepSpeed's bf16 optimizer apply an update with NaN/inf gradients, which trainer.nonfinite "
            '"skip" needs dropped; leave it "auto" (true under "skip")',
        )
    if document["zero_optimization"]["stage"] == 0 and not mixed:
        yield ConfigIssue(
            "trainer.nonfinite",
            '"skip" needs an optimizer that drops an update with NaN/inf gradients, and DeepSpeed\'s fp32 ZeRO-0 '
            "optimizer applies it; skip works under zero_optimization.stage 1-3, with bf16.enabled or "
            'fp16.enabled true, or on the accelerate backend; otherwise use "stop"',
        )


def check_accelerate_backend(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """What the accelerate backend (DDP / torch FSDP2) cannot honour of a DeepSpeed-shaped config."""
    if effective_backend(document["trainer"]["backend"]) != "accelerate":
        return
    for key in ("pipeline_parallel_size", "tensor_parallel_size"):
        if document["parallel"][key] > 1:
            yield ConfigIssue(
                f"parallel.{key}",
                "pipeline and tensor parallelism run on the DeepSpeed backend only; set it to 1, or launch with "
                'deepspeed and trainer.backend "deepspeed"',
            )
    if document["zero_optimization"]["stage"] not in ACCELERATE_WRAPPERS:
        yield ConfigIssue(
            "zero_optimization.stage",
            "FSDP has no optimizer-only sharding; under the accelerate backend use 0 (DDP), 2 (FSDP sharding "
            "gradients and optimizer states) or 3 (FSDP sharding parameters too)",
        )
    if document["fp16"]["enabled"] is True:
        yield ConfigIssue(
            "fp16.enabled",
            "the accelerate backend trains in fp32 or bf16 (fp16 needs a loss scaler it does not run); use bf16, "
            "or the DeepSpeed backend",
        )
    if document["optimizer"]["params"].get("bias_correction") is False:
        yield ConfigIssue(
            "optimizer.params.bias_correction",
            "false is not supported on the accelerate backend, which steps torch's Adam, and torch's Adam always "
            'corrects; drop the key, or train on the DeepSpeed backend (trainer.backend "deepspeed"), whose Adam '
            "implements it",
        )


_MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def check_monitors(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    """DeepSpeed imports a monitor's package inside `deepspeed.initialize`, after every rank has
    started; a missing one is better named here, before anything launches."""
    for key, package in _MONITOR_PACKAGES.items():
        if document.get(key, {}).get("enabled") and importlib.util.find_spec(package) is None:
            yield ConfigIssue(
                f"{key}.enabled", f"the {package} package is not installed; `pip install {package}` or set it to false"
            )


def check_deepspeed_support(document: dict, world_size: int, hardware: Hardware | None) -> Iterator[ConfigIssue]:
    yield from unsupported_issues(document)


RULES: tuple[Rule, ...] = (
    check_parallel_layout,
    check_pipeline,
    check_tensor_parallel,
    check_sequence_parallel,
    check_tiling,
    check_kernels,
    check_batch,
    check_precision,
    check_zero,
    check_scheduler,
    check_model,
    check_lora,
    check_data,
    check_trainer,
    check_nonfinite,
    check_accelerate_backend,
    check_monitors,
    check_deepspeed_support,
)


def rule_issues(document: dict, world_size: int, hardware: Hardware | None) -> list[ConfigIssue]:
    """Every cross-field problem of a schema-valid, defaults-filled document."""
    return [issue for rule in RULES for issue in rule(document, world_size, hardware)]
