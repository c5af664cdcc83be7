"""The JSON Schema (Draft 2020-12) of an engine config: the one place where every key's type,
range, default and description live.

The document is assembled from small helpers so that each field reads as one line, but what
leaves this module is plain JSON Schema: `python -m engine schema` prints it, the config
reference in docs/ is generated from it, and validation runs it through `jsonschema`.

DeepSpeed's keys sit at the top level exactly as DeepSpeed documents them, so an existing
ds_config works as a base. Every default is written out here on purpose rather than inherited
from DeepSpeed, whose defaults change between releases (0.19 turned `gradient_clipping` on).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from data.kinds import KINDS, kind_schema
from engine.config.deepspeed_facts import deepspeed_facts
from models import FAMILIES
from models.lora import LORA_SCHEMA

AUTO = "auto"


def _field(json_type: str, description: str, default: Any = None, auto: bool = False, **constraints: Any) -> dict:
    """One scalar field; `auto` admits the string "auto", resolved by engine.config.resolve."""
    schema: dict[str, Any] = {"type": json_type, **constraints}
    if auto:
        schema = {"anyOf": [schema, {"const": AUTO}]}
    schema["description"] = description
    if default is not None:
        schema["default"] = default
    return schema


def _integer(description: str, default: Any = None, minimum: int | None = None, auto: bool = False, **kw: Any) -> dict:
    if minimum is not None:
        kw["minimum"] = minimum
    return _field("integer", description, default, auto, **kw)


def _number(description: str, default: Any = None, auto: bool = False, **kw: Any) -> dict:
    return _field("number", description, default, auto, **kw)


def _boolean(description: str, default: Any = None, auto: bool = False) -> dict:
    return _field("boolean", description, default, auto)


def _enum(choices: list[str], description: str, default: str | None = None) -> dict:
    schema: dict[str, Any] = {"enum": choices, "description": description}
    if default is not None:
        schema["default"] = default
    return schema


def _object(description: str, properties: dict[str, dict], required: list[str] | None = None, **kw: Any) -> dict:
    schema: dict[str, Any] = {
        "type": "object",
        "description": description,
        "properties": properties,
        "additionalProperties": False,
        **kw,
    }
    if required:
        schema["required"] = required
    return schema


def _when(key: str, value: str, then: dict, default: str | None = None) -> dict:
    """`then` applies where `key` is `value`, or is absent and `value` is its `default`."""
    condition: dict[str, Any] = {"properties": {key: {"const": value}}}
    if value != default:
        condition["required"] = [key]
    return {"if": condition, "then": then}


def _overlay(deepspeed: dict, engine: dict) -> dict:
    """DeepSpeed's schema of a section with the engine's fields laid over it: the engine's field
    wins where both define one (its default, its "auto", its description), DeepSpeed's fields fill
    in the rest. A section DeepSpeed allows to be null is an object here (the engine fills it)."""
    if "anyOf" in deepspeed:
        deepspeed = next((option for option in deepspeed["anyOf"] if option.get("type") == "object"), deepspeed)
    if deepspeed.get("type") != "object" or engine.get("type") != "object":
        return engine
    merged = {**copy.deepcopy(deepspeed), **{key: value for key, value in engine.items() if key != "properties"}}
    properties = copy.deepcopy(deepspeed.get("properties", {}))
    for key, field in engine.get("properties", {}).items():
        properties[key] = _overlay(properties[key], field) if key in properties else field
    merged["properties"] = properties
    return merged


def _deepspeed_section(key: str, engine: dict) -> dict:
    """The top-level section `key`, from DeepSpeed's pydantic model with the engine's fields over it."""
    return _overlay(deepspeed_facts().section_schema(key), engine)


# ---------------------------------------------------------------------------------------------
# DeepSpeed keys
# ---------------------------------------------------------------------------------------------

_BATCH = {
    "train_batch_size": _integer(
        "Samples per optimizer step over all data-parallel ranks. Must equal micro-batch x "
        "gradient_accumulation_steps x data-parallel size; any one of the three may be left out or "
        '"auto" and is solved from the other two, as DeepSpeed does.',
        minimum=1,
        auto=True,
    ),
    "train_micro_batch_size_per_gpu": _integer("Samples per forward/backward pass on one rank.", minimum=1, auto=True),
    "gradient_accumulation_steps": _integer(
        "Micro-batches accumulated before each optimizer step.", minimum=1, auto=True
    ),
}

# HF's Trainer and accelerate fill "auto" in these keys from TrainingArguments; the engine has no
# TrainingArguments, so "auto" there is the key's own default (engine/config/resolve.py).
_HF_AUTO = ' "auto" (HF Trainer\'s placeholder for a TrainingArguments value): this default.'

_ADAM_PARAMS = {
    "lr": _number("Peak learning rate." + _HF_AUTO, 3e-4, auto=True, exclusiveMinimum=0),
    "betas": {
        "anyOf": [
            {
                "type": "array",
                "items": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
                "minItems": 2,
                "maxItems": 2,
            },
            {"const": AUTO},
        ],
        "description": "Adam's (beta1, beta2)." + _HF_AUTO,
        "default": [0.9, 0.999],
    },
    "eps": _number("Adam's epsilon." + _HF_AUTO, 1e-8, auto=True, exclusiveMinimum=0),
    "weight_decay": _number(
        "Decoupled (AdamW) or L2 (Adam with adam_w_mode false) weight decay." + _HF_AUTO, 0.0, auto=True, minimum=0
    ),
    "bias_correction": _boolean(
        "Adam's bias correction (FusedAdam's and DeepSpeedCPUAdam's argument). false runs DeepSpeed's own Adam, "
        'whose kernels implement it (torch_adam "auto" resolves to false); refused with torch_adam true and on the '
        "accelerate backend, whose torch Adam always corrects. Under torch_adam, true is left out of what reaches "
        "DeepSpeed, which would hand it to torch."
    ),
    "adam_w_mode": _boolean(
        'DeepSpeed runs "Adam" as AdamW unless this is false; the default keeps that behaviour explicit.',
        True,
    ),
    "torch_adam": _boolean(
        "Use torch.optim.Adam/AdamW instead of DeepSpeed's FusedAdam (the same update); false asks for FusedAdam by "
        'name. "auto": true, so the optimizer needs no compiler, except under optimizer offload (DeepSpeed\'s C++ CPU '
        "Adam is the host optimizer), with legacy_fusion (read by FusedAdam's fp16 wrapper only) and with "
        "bias_correction false (torch's Adam always corrects). A DeepSpeed op a run needs is checked in "
        "every rank's pre-flight, before any process group, and built by one rank of each node while the "
        "others wait.",
        AUTO,
        auto=True,
    ),
    "fused": _boolean(
        "torch's fused Adam/AdamW kernel (torch.optim.AdamW(fused=True)): one launch per step for all tensors, as "
        "FusedAdam is, built into torch. Only where torch's Adam runs (torch_adam, or the accelerate backend); false "
        "leaves torch its default (foreach on a GPU). "
        '"auto": true where torch\'s Adam steps parameters on a CUDA device (nothing of the optimizer offloaded; '
        "under the accelerate backend nothing offloaded at all), false elsewhere.",
        AUTO,
        auto=True,
    ),
}

_SGD_PARAMS = {
    "lr": _number("Learning rate." + _HF_AUTO, 0.1, auto=True, exclusiveMinimum=0),
    "momentum": _number("Momentum factor.", 0.9, minimum=0),
    "weight_decay": _number("L2 penalty." + _HF_AUTO, 0.0, auto=True, minimum=0),
    "nesterov": _boolean("Nesterov momentum.", False),
    "dampening": _number("Dampening for momentum.", 0.0, minimum=0),
}

_OPTIMIZER = _object(
    "DeepSpeed optimizer section. Adam/AdamW run as DeepSpeed builds them (FusedAdam, torch Adam, or "
    "DeepSpeedCPUAdam under offload_optimizer); SGD is torch.optim.SGD.",
    {
        "type": _enum(["Adam", "AdamW", "SGD"], "Optimizer name, spelled as DeepSpeed spells it.", "AdamW"),
        "legacy_fusion": _boolean("DeepSpeed's older fused fp16 optimizer wrapper (fp16 on DeepSpeed only)."),
        "params": {"type": "object", "description": "Keyword arguments of the optimizer.", "default": {}},
    },
    allOf=[
        _when("type", name, {"properties": {"params": _object(f"{name} parameters.", params)}}, default="AdamW")
        for name, params in (("Adam", _ADAM_PARAMS), ("AdamW", _ADAM_PARAMS), ("SGD", _SGD_PARAMS))
    ],
    default={"type": "AdamW", "params": {}},
)

_WARMUP_COMMON = {
    "warmup_num_steps": _integer(
        "Steps of warm-up; at least 2, the fewest DeepSpeed runs (it raises a lower count to 2, as its log "
        'warm-up divides by the logarithm of the count). "auto": 1% of trainer.max_steps, at least 2 (Megatron-LM\'s '
        "--lr-warmup-fraction 0.01).",
        1000,
        minimum=2,
        auto=True,
    ),
    "warmup_type": _enum(["log", "linear"], "Shape of the warm-up curve.", "log"),
}
_WARMUP_LR_PARAMS = {
    "warmup_min_lr": _number("Learning rate at step 0." + _HF_AUTO, 0.0, auto=True, minimum=0),
    "warmup_max_lr": _number('Learning rate after warm-up; "auto": optimizer.params.lr.', AUTO, auto=True, minimum=0),
    **_WARMUP_COMMON,
}
_TOTAL_STEPS = _integer('Steps over which the schedule runs; "auto": trainer.max_steps.', AUTO, minimum=1, auto=True)

_SCHEDULER = _object(
    "DeepSpeed LR schedule, stepped once per optimizer step. Absent: constant learning rate.",
    {
        "type": _enum(["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"], "Schedule name, as DeepSpeed spells it."),
        "params": {"type": "object", "description": "Keyword arguments of the schedule.", "default": {}},
    },
    required=["type"],
    allOf=[
        _when("type", "WarmupLR", {"properties": {"params": _object("WarmupLR parameters.", _WARMUP_LR_PARAMS)}}),
        _when(
            "type",
            "WarmupDecayLR",
            {
                "properties": {
                    "params": _object(
                        "WarmupDecayLR parameters.", {**_WARMUP_LR_PARAMS, "total_num_steps": _TOTAL_STEPS}
                    )
                }
            },
        ),
        _when(
            "type",
            "WarmupCosineLR",
            {
                "properties": {
                    "params": _object(
                        "WarmupCosineLR parameters.",
                        {
                            **_WARMUP_COMMON,
                            "total_num_steps": _TOTAL_STEPS,
                            "warmup_min_ratio": _number("Start of warm-up as a fraction of lr.", 0.0, minimum=0),
                            "cos_min_ratio": _number("End of the cosine as a fraction of lr.", 0.0001, minimum=0),
                        },
                    )
                }
            },
        ),
    ],
)

_FP16 = _deepspeed_section(
    "fp16",
    _object(
        "Mixed precision with fp16 and a dynamic loss scale (only where the device supports fp16).",
        {
            "enabled": _boolean(
                '"auto": on only where bf16 is unsupported and fp16 is (older GPUs).', False, auto=True
            ),
            "loss_scale": _number("0 for a dynamic loss scale, else a fixed scale.", 0.0, minimum=0),
            "initial_scale_power": _integer("The dynamic scale starts at 2**this.", 16, minimum=0),
            "loss_scale_window": _integer("Steps without overflow before the scale grows.", 1000, minimum=1),
            "hysteresis": _integer("Overflows tolerated before the scale shrinks.", 2, minimum=1),
            "min_loss_scale": _number("Floor of the dynamic scale.", 1.0, exclusiveMinimum=0),
        },
        default={},
    ),
)

_BF16 = _deepspeed_section(
    "bf16",
    _object(
        "Mixed precision with bf16 weights and fp32 master weights.",
        {
            "enabled": _boolean(
                '"auto": on where the device supports bf16 (GPUs with it), off on CPU; at ZeRO stage 0 on DeepSpeed\'s '
                "whole-model engine it picks torch_autocast instead (DeepSpeed's bf16 wrapper without ZeRO reads every "
                "gradient back to the host at each step).",
                False,
                auto=True,
            ),
            "check_grad_overflow": _boolean(
                "Whether DeepSpeed's ZeRO optimizer tests the gradients for NaN/inf before each update and drops it: "
                'a host read of the device at every step. "auto": only under trainer.nonfinite "skip", which needs the '
                'drop; under "stop" the engine\'s own check, read at log, evaluation and save points, stops the run '
                "before a bad step is saved (docs/failures.md).",
                AUTO,
                auto=True,
            ),
        },
        default={},
    ),
)

_TIMERS = _object(
    "DeepSpeed's timers.",
    {
        "throughput": _overlay(
            deepspeed_facts().timer_schema("throughput"),
            _object(
                "DeepSpeed's throughput timer (samples/s in its progress lines). It synchronises the device at the "
                "start and end of every forward when synchronized, so the engine turns it off: its own metrics time "
                "the steps it logs.",
                {
                    "enabled": _boolean("Run the throughput timer.", False),
                    "synchronized": _boolean("Synchronise the device around each timed forward.", True),
                },
                default={},
            ),
        )
    },
    default={},
)

_TORCH_AUTOCAST = _object(
    "DeepSpeed's torch.autocast route to bf16: fp32 weights, gradients and Adam states (the optimizer steps the "
    "weights themselves, no master copy), matrix products in bf16, as torch's autocast does. The same 16 bytes of "
    "model state per parameter as bf16 with an fp32 master, and a third to a sixth of its host operations per "
    "optimizer step (docs/design/precision.md). "
    'Instead of bf16/fp16 ("auto" there turns off); DeepSpeed\'s whole-model engine only.',
    {
        "enabled": _boolean("Train under torch.autocast.", False),
        "dtype": _enum(
            ["bfloat16", "bf16", "torch.bfloat16"],
            "The autocast dtype, in any of DeepSpeed's spellings (fp16 has DeepSpeed's loss-scaled fp16 route).",
            "bfloat16",
        ),
        "lower_precision_safe_modules": {
            "type": "array",
            "items": {"type": "string"},
            "description": "Module classes (package.Class) whose parameters' gradients ZeRO reduces in bf16, half "
            "the bytes of fp32. [] (the default): every gradient reduced in fp32, as one process sums it. "
            "DeepSpeed's own default is torch.nn.modules.linear.Linear and torch.nn.modules.conv.Conv1d/2d/3d; "
            "on the tests' tiny GPT at ZeRO-2 it moved the weights 2e-3 from the reference in 5 steps.",
            "default": [],
        },
    },
    default={},
)

_DATA_TYPES = _object(
    "DeepSpeed's dtype controls for the module cast under fp16/bf16.",
    {
        "buffer_dtype": {
            "enum": ["auto", "fp32", "fp16", "bf16", None],
            "description": "dtype of floating buffers under mixed precision. DeepSpeed 0.19 casts only parameters, "
            'which leaves BatchNorm statistics in fp32 next to bf16 inputs (an error). "auto": the training '
            "dtype under fp16/bf16, unchanged (null) in fp32; null keeps buffers as loaded.",
            "default": AUTO,
        },
        "grad_accum_dtype": {
            "enum": ["fp32", "fp16", "bf16", None],
            "description": "dtype gradients accumulate in over micro-batches (DeepSpeed's default, null: the "
            "training dtype; fp32 under bf16 keeps a high-precision accumulator).",
        },
        "param_dtype": {
            "enum": ["fp32", "fp16", "bf16", None],
            "description": "dtype DeepSpeed casts the parameters to (null: the training dtype).",
        },
        "keep_in_fp32_modules": {
            "anyOf": [{"const": AUTO}, {"type": "array", "items": {"type": "string"}}],
            "description": "Name patterns of modules whose buffers DeepSpeed keeps in fp32 under mixed precision "
            '(DeepSpeed\'s default "auto": its own list).',
        },
    },
    default={},
)

_DTYPE_NAME = {"enum": ["fp32", "fp16", "bf16", None]}

# DeepSpeed reads these top-level keys with plain dictionary lookups (deepspeed/runtime/config.py),
# not through a pydantic model; each is described from DeepSpeed's documentation and its default.
_DEEPSPEED_SCALARS = {
    "prescale_gradients": _boolean("Divide gradients by the data-parallel size before the all-reduce, not after."),
    "gradient_predivide_factor": _number(
        "Divide gradients by this before the all-reduce and by data-parallel size / this after.", exclusiveMinimum=0
    ),
    "gradient_allreduce_op": _enum(["mean", "sum"], "How data-parallel gradients combine (DeepSpeed's default: mean)."),
    "communication_data_type": {
        **_DTYPE_NAME,
        "description": "dtype of gradient collectives (null: DeepSpeed picks from the training precision).",
    },
    "seq_parallel_communication_data_type": {
        **_DTYPE_NAME,
        "description": "dtype of sequence-parallel collectives (DeepSpeed's default: fp32).",
    },
    "disable_allgather": _boolean("Broadcast updated partitions instead of all-gathering them."),
    "dump_state": _boolean("Print DeepSpeed's state after initialisation."),
    "disable_python_gc": _boolean("Turn Python's garbage collector off during training steps."),
    "memory_breakdown": _boolean("Log device memory use at points of each step (synchronises the device)."),
    "dataloader_drop_last": _boolean("Drop the last incomplete batch of DeepSpeed's own data loader."),
    "use_data_before_expert_parallelism": _boolean("Lay data-parallel ranks out before expert-parallel ones."),
    "managed_gradient_accumulation": _boolean("Let DeepSpeed count micro-batches to the optimizer step."),
    "vocabulary_size": _integer(
        "Vocabulary size DeepSpeed checks for tensor-core alignment (a warning only).", minimum=1
    ),
    "log_level": {"type": ["string", "null"], "description": "DeepSpeed's logger level."},
}

_ACTIVATION_CHECKPOINTING = _object(
    "DeepSpeed's activation checkpointing (deepspeed.checkpointing), which its pipeline engine runs for "
    "parallel.pipeline_activation_checkpoint_interval.",
    {
        "partition_activations": _boolean("Split checkpointed activations across the model-parallel ranks."),
        "contiguous_memory_optimization": _boolean("Copy checkpoints into one contiguous buffer."),
        "cpu_checkpointing": _boolean("Keep checkpointed activations in host memory."),
        "number_checkpoints": {"type": ["integer", "null"], "description": "Checkpoints a forward holds."},
        "synchronize_checkpoint_boundary": _boolean("Synchronise the device at each checkpoint boundary."),
        "profile": _boolean("Time the checkpointed forward and backward."),
    },
)

_FLOPS_PROFILER = _object(
    "DeepSpeed's flops profiler: one step's FLOPs, latency and parameters per module, printed by rank 0.",
    {
        "enabled": _boolean("Profile one step."),
        "recompute_fwd_factor": _number("Forward passes recomputed per step (activation checkpointing).", minimum=0),
        "profile_step": _integer("The step profiled.", minimum=1),
        "module_depth": _integer("Depth of modules printed; -1: all."),
        "top_modules": _integer("Modules listed per depth.", minimum=1),
        "detailed": _boolean("Print per-module detail."),
        "output_file": {"type": ["string", "null"], "description": "File for the profile; null: stdout."},
    },
)

_CHECKPOINT = _object(
    "DeepSpeed's checkpoint options.",
    {
        "tag_validation": {
            "enum": ["Ignore", "Warn", "Fail", "IGNORE", "WARN", "FAIL", "ignore", "warn", "fail"],
            "description": "Check that every rank saves under the same tag.",
        },
        "load_universal": _boolean("Load a universal checkpoint; the engine sets this itself when a layout changes."),
        "use_node_local_storage": _boolean("Each node saves to its own disk (no shared file system)."),
        "parallel_write": _object(
            "Parallel checkpoint writing.", {"pipeline_stage": _boolean("Each pipeline stage writes in parallel.")}
        ),
        "checkpoint_serialization": _boolean("Serialise tensors with torch.save's zipfile format."),
        "writer": {"type": ["object", "null"], "description": "DeepSpeed's FastPersist checkpoint writer."},
    },
)


@dataclass(frozen=True)
class Spelling:
    """A DeepSpeed key for a feature the engine runs under a key of its own: `path` is read as `key`
    (engine/config/validate.py `canonical_spellings`, one notice line), and refused beside it, or beside
    another spelling of it, with another value. `read` turns the value into the engine key's."""

    path: tuple[str, ...]  # a DeepSpeed section and its key, or a top-level key alone
    key: tuple[str, str]
    feature: str  # what both keys set, as the notice and the refusal name it
    schema: dict
    read: Callable[[Any], Any] = lambda value: value

    def describe(self) -> dict:
        """The spelling's schema, described by what it is read as."""
        key = ".".join(self.key)
        said = f"DeepSpeed's spelling of {self.feature}: read as {key}, with one notice line; refused beside {key}"
        return {**self.schema, "description": f"{said} with another value. {self.schema['description']}".strip()}


# DeepSpeed's spellings of the engine's tensor parallelism, pipeline stages and sequence parallelism.
# The engine runs them itself (models/ plans, PipelineModule, DeepSpeed's Ulysses set up by
# engine/parallel/sequence.py), so each DeepSpeed key is read as the engine's. Nothing of the first
# two reaches DeepSpeed, whose AutoTP would rewrite the model a second time; the sequence-parallel
# degree is handed back to it by `EngineConfig.deepspeed_config`, as its batch arithmetic reads it.
SPELLINGS: tuple[Spelling, ...] = (
    Spelling(
        ("tensor_parallel", "autotp_size"),
        ("parallel", "tensor_parallel_size"),
        "the tensor-parallel degree",
        _integer("DeepSpeed's AutoTP request; 0, DeepSpeed's off, reads as 1.", minimum=0),
        lambda size: 1 if size == 0 else size,
    ),
    Spelling(
        ("tensor_parallel", "tp_size"),
        ("parallel", "tensor_parallel_size"),
        "the tensor-parallel degree",
        _integer("As DeepSpeed's inference config writes it.", minimum=1),
    ),
    Spelling(
        ("pipeline", "pipeline_parallel_size"),
        ("parallel", "pipeline_parallel_size"),
        "the pipeline-stage count",
        _integer("", minimum=1),
    ),
    Spelling(
        ("pipeline", "activation_checkpoint_interval"),
        ("parallel", "pipeline_activation_checkpoint_interval"),
        "the pipeline's activation-checkpoint interval",
        _integer("DeepSpeed's pipeline engine would set its stages' interval from it, over the engine's.", minimum=0),
    ),
    Spelling(
        ("sequence_parallel_size",),
        ("parallel", "sequence_parallel_size"),
        "the sequence-parallel degree",
        _integer("DeepSpeed-Ulysses' degree, as DeepSpeed's ALST configs write it.", minimum=1),
    ),
)


def _spelled_in(section: str | None) -> dict[str, dict]:
    """The spellings under DeepSpeed section `section`, by key; None: the top-level ones."""
    where = () if section is None else (section,)
    return {spelling.path[-1]: spelling.describe() for spelling in SPELLINGS if spelling.path[:-1] == where}


# DeepSpeed reads the section with plain lookups (deepspeed/runtime/config.py get_pipeline_config);
# its pipeline engine acts on these keys (deepspeed/runtime/pipe/engine.py).
_PIPELINE = _object(
    "DeepSpeed's pipeline engine options, for pipeline stages (parallel.pipeline_parallel_size > 1).",
    {
        **_spelled_in("pipeline"),
        "pipe_partitioned": _boolean(
            "Under tensor parallelism, each stage sends its activations split across its tensor-parallel ranks, and "
            "the next stage all-gathers them; false: every rank sends them whole to its counterpart. No effect "
            "without tensor parallelism. DeepSpeed's default: true."
        ),
        "grad_partitioned": _boolean(
            "The same for the gradients each stage sends back to the one before. DeepSpeed's default: true."
        ),
        "use_reentrant": {
            "enum": [False],
            "description": "Only false, what runs: the engine's stages recompute with DeepSpeed's non-reentrant "
            "checkpoint (parallel.pipeline_activation_checkpoint_interval). DeepSpeed's default, true, asks for the "
            "reentrant one, which the engine does not run.",
        },
    },
)

_TENSOR_PARALLEL = {
    "type": "object",
    "description": "DeepSpeed's AutoTP. Its size is read as parallel.tensor_parallel_size: the engine's own tensor "
    "parallelism, split by the model family's plan (models/). AutoTP's other options rewrite the model by "
    "DeepSpeed's rules and are refused.",
    "properties": _spelled_in("tensor_parallel"),
}


def _feature(description: str) -> dict:
    """A DeepSpeed section the engine refuses where it is on (engine/config/support.py says why): any
    keys DeepSpeed takes, since it is only read to be refused or to be off."""
    return {"type": "object", "description": description}


# deepspeed/runtime/swap_tensor/constants.py: what DeepSpeed's NVMe swapper reads, with its defaults.
_AIO = _object(
    "DeepSpeed's asynchronous I/O (libaio), through which ZeRO-Infinity swaps parameters and optimizer states "
    "to offload_*.nvme_path. Only tensors of at least max(1 MiB, block_size) are swapped; smaller ones stay in "
    "host memory.",
    {
        "block_size": _integer("Bytes per I/O request.", 1_048_576, minimum=1),
        "queue_depth": _integer("I/O requests in flight per thread.", 8, minimum=1),
        "intra_op_parallelism": _integer(
            "Threads that split each read or write (DeepSpeed's older name, thread_count, is read as this).",
            1,
            minimum=1,
        ),
        "single_submit": _boolean("Submit requests one at a time instead of in batches.", False),
        "overlap_events": _boolean("Overlap submitting requests with waiting for finished ones.", True),
        "use_gds": _boolean("NVIDIA GPUDirect Storage: GPU memory to NVMe without the host (needs its driver).", False),
    },
)

_FEATURES = {
    "aio": _AIO,
    "autotuning": _feature("DeepSpeed's autotuner, run by `deepspeed --autotuning`."),
    "data_efficiency": _feature("DeepSpeed's data efficiency: curriculum learning and random-LTD through its sampler."),
    "expert_parallel": _feature("DeepSpeed's automatic expert parallelism for mixture-of-experts models."),
    "pipeline": _PIPELINE,
    "weight_quantization": _feature("DeepSpeed's post-training weight quantization."),
    "datastates_ckpt": _feature("DataStates-LLM asynchronous checkpointing."),
    **_spelled_in(None),
}

_OFFLOAD_OPTIMIZER = _object(
    "ZeRO-Offload of optimizer states (and the optimizer step) to host memory. ZeRO stage >= 1.",
    {
        "device": _enum(
            ["none", "cpu", "nvme", AUTO],
            'Where the optimizer states live. "auto": the offload_optimizer_device of the accelerate DeepSpeed-plugin '
            'yaml the run was launched with, else "none".',
            "none",
        ),
        "pin_memory": _boolean("Page-locked host buffers (faster copies to a GPU).", False),
    },
    default={},
)

_OFFLOAD_PARAM = _object(
    "ZeRO-Infinity offload of parameters to host memory. ZeRO stage 3 only.",
    {
        "device": _enum(
            ["none", "cpu", "nvme", AUTO],
            'Where the parameters live between uses. "auto": the offload_param_device of the accelerate '
            'DeepSpeed-plugin yaml the run was launched with, else "none".',
            "none",
        ),
        "pin_memory": _boolean("Page-locked host buffers (faster copies to a GPU).", False),
    },
    default={},
)

_ZERO = _deepspeed_section(
    "zero_optimization",
    _object(
        "ZeRO redundancy elimination: 1 partitions optimizer states, 2 also gradients, 3 also parameters.",
        {
            "stage": _integer(
                'ZeRO stage, 0 (plain data parallelism) to 3. "auto": the zero_stage of the accelerate '
                "DeepSpeed-plugin yaml the run was launched with, else 0.",
                0,
                minimum=0,
                maximum=3,
                auto=True,
            ),
            "offload_optimizer": _OFFLOAD_OPTIMIZER,
            "offload_param": _OFFLOAD_PARAM,
            "overlap_comm": _boolean("Overlap gradient reduction with the backward pass.", False),
            "contiguous_gradients": _boolean("Copy gradients into one contiguous buffer as they are produced.", True),
            "reduce_scatter": _boolean("Reduce gradients with reduce-scatter instead of all-reduce.", True),
            "allgather_partitions": _boolean("All-gather updated partitions instead of broadcasts.", True),
            "reduce_bucket_size": _integer(
                'Elements reduced at a time; "auto": Megatron-LM\'s bucket, max(4e7, 1e6 x data-parallel ranks).',
                AUTO,
                minimum=1,
                auto=True,
            ),
            "allgather_bucket_size": _integer("Elements all-gathered at a time.", 500_000_000, minimum=1),
            "round_robin_gradients": _boolean("Stage 1/2: spread gradient copies over ranks round-robin.", False),
            "stage3_prefetch_bucket_size": _integer(
                'Stage 3: elements prefetched ahead; "auto": DeepSpeed\'s 5e7.',
                AUTO,
                minimum=0,
                auto=True,
            ),
            "stage3_param_persistence_threshold": _integer(
                'Stage 3: parameters smaller than this stay unpartitioned; "auto": 10 x hidden size (GPT), else 1e5.',
                AUTO,
                minimum=0,
                auto=True,
            ),
            "stage3_max_live_parameters": _integer(
                "Stage 3: most elements resident before release.", 1_000_000_000, minimum=0
            ),
            "stage3_max_reuse_distance": _integer(
                "Stage 3: keep parameters reused within this many.", 1_000_000_000, minimum=0
            ),
            "stage3_gather_16bit_weights_on_model_save": _boolean(
                "Stage 3: every checkpoint also holds the gathered weights, in the training precision, as "
                'pytorch_model.bin (DeepSpeed\'s save_16bit_model). "auto": the zero3_save_16bit_model of the '
                "accelerate DeepSpeed-plugin yaml the run was launched with, else false.",
                False,
                auto=True,
            ),
            "sub_group_size": _integer("Stage 3: elements per optimizer sub-group.", 1_000_000_000, minimum=1),
        },
        default={},
    ),
)

_MONITOR_OUTPUT_PATH = {
    "type": "string",
    "description": 'Directory of the files; "auto": <trainer.output_dir>/monitor, so they stay with the run.',
    "default": AUTO,
}
_MONITOR_JOB_NAME = {
    "type": "string",
    "description": "Subdirectory of output_path the files go into.",
    "default": "DeepSpeedJobName",
}

_TENSORBOARD = _deepspeed_section(
    "tensorboard",
    _object(
        "TensorBoard event files through DeepSpeed's monitor: the engine's metrics (as Train/Samples/<metric>, "
        "x = samples seen) beside DeepSpeed's own Train/Samples events. Needs the tensorboard package.",
        {
            "enabled": _boolean("Write TensorBoard event files on rank 0.", False),
            "output_path": _MONITOR_OUTPUT_PATH,
            "job_name": _MONITOR_JOB_NAME,
        },
        default={},
    ),
)

_CSV_MONITOR = _deepspeed_section(
    "csv_monitor",
    _object(
        "CSV files through DeepSpeed's monitor, one per metric (<output_path>/<job_name>/Train_Samples_<metric>.csv, "
        "columns step and the metric, step counting samples seen).",
        {
            "enabled": _boolean("Write CSV files on rank 0.", False),
            "output_path": _MONITOR_OUTPUT_PATH,
            "job_name": _MONITOR_JOB_NAME,
        },
        default={},
    ),
)

_WANDB = _deepspeed_section(
    "wandb",
    _object(
        "Weights & Biases logging through DeepSpeed's monitor (the same events as tensorboard). Needs the wandb "
        "package; WANDB_MODE=offline keeps it local.",
        {
            "enabled": _boolean("Log to W&B from rank 0.", False),
            "group": {"type": ["string", "null"], "description": "W&B group the run joins.", "default": None},
            "team": {
                "type": ["string", "null"],
                "description": "W&B team (entity); null: your default.",
                "default": None,
            },
            "project": {"type": "string", "description": "W&B project.", "default": "deepspeed"},
        },
        default={},
    ),
)

DEEPSPEED_PROPERTIES: dict[str, dict] = {
    **_BATCH,
    "gradient_clipping": _number(
        'Global gradient-norm clip; 0 disables. "auto": 1.0. Written explicitly because DeepSpeed 0.19 '
        "changed its own default from off to 1.0.",
        1.0,
        auto=True,
        minimum=0,
    ),
    "optimizer": _OPTIMIZER,
    "scheduler": _SCHEDULER,
    "fp16": _FP16,
    "bf16": _BF16,
    "torch_autocast": _TORCH_AUTOCAST,
    "data_types": _DATA_TYPES,
    "zero_optimization": _ZERO,
    "zero_allow_untested_optimizer": _boolean("Let ZeRO run optimizers DeepSpeed has not tested (SGD).", False),
    "zero_force_ds_cpu_optimizer": _boolean(
        "Under offload_optimizer, refuse a client optimizer other than DeepSpeedCPUAdam (the fast host optimizer); "
        "the config's own optimizer, torch_adam included, always passes.",
        True,
    ),
    "steps_per_print": _integer(
        "DeepSpeed's own progress lines; the engine logs on its own, so this is rare by default.", 1000, minimum=1
    ),
    "wall_clock_breakdown": _boolean(
        "DeepSpeed's forward/backward/step timers in its logs (each synchronises the device).", False
    ),
    "timers": _TIMERS,
    "tensorboard": _TENSORBOARD,
    "csv_monitor": _CSV_MONITOR,
    "wandb": _WANDB,
    **{key: deepspeed_facts().section_schema(key) for key in ("comet", "comms_logger", "compile", "hybrid_engine")},
    "tensor_parallel": _TENSOR_PARALLEL,
    "activation_checkpointing": _ACTIVATION_CHECKPOINTING,
    "flops_profiler": _FLOPS_PROFILER,
    "checkpoint": _CHECKPOINT,
    **_DEEPSPEED_SCALARS,
    **_FEATURES,
}

# ---------------------------------------------------------------------------------------------
# The engine's own sections
# ---------------------------------------------------------------------------------------------

_MODEL_COMMON = {
    "family": _enum(list(FAMILIES), "Model family; selects the registry entry in models/."),
    "activation_checkpointing": {
        "anyOf": [
            {"type": "boolean"},
            {"const": "attention"},
            {
                "type": "object",
                "properties": {
                    "every": _integer(
                        "Recompute blocks 0, k, 2k, ... whole; the others keep their activations.", 1, minimum=1
                    ),
                    "offload": _boolean(
                        "Keep what the recomputed blocks save for the backward pass, their inputs, in host memory "
                        "(pinned where CUDA is), copied back for the recomputation.",
                        False,
                    ),
                },
                "additionalProperties": False,
            },
        ],
        "description": "Recompute activations in the backward pass instead of keeping them: true recomputes every "
        'transformer block (every residual block of a ResNet); {"every": k} every k-th block, the others keeping '
        'theirs; "attention" only the attention of each transformer block (Megatron\'s selective recompute: its '
        'scores are the largest activations and cheap to redo); {"offload": true}, alone or with "every", moves '
        "the inputs the recomputed blocks keep to host memory. Not under pipeline parallelism, whose stages "
        "recompute by parallel.pipeline_activation_checkpoint_interval.",
        "default": False,
    },
    "init_from": {
        "type": ["string", "null"],
        "description": "Local directory of weights to start from (an HF checkpoint for GPT and Llama, an engine "
        "export for ResNet). GPT and Llama: as from_pretrained does, its config.json alone decides the "
        "architecture (model.preset is optional and gives way to it; a field written here that disagrees with it "
        "is an error), and where it holds tokenizer files and data.tokenizer is not given, they are the tokenizer.",
        "default": None,
    },
    # Every family's, so that a family without a LoRA form refuses it by name (engine/config/rules.py).
    "lora": dict(LORA_SCHEMA),
}

_MODEL = {
    "type": "object",
    "description": "What to train. Fields depend on the family.",
    "properties": {
        "family": _MODEL_COMMON["family"],
        # Listed here too, so that the config reference describes it once rather than per family.
        "lora": _MODEL_COMMON["lora"],
        "preset": {
            "type": "string",
            "description": "Size preset of the family; required unless model.init_from names an HF checkpoint "
            "(GPT, Llama), whose config.json decides the architecture.",
        },
    },
    # model.preset's requirement depends on model.init_from's directory: engine/config/pretrained.py.
    "required": ["family"],
    "allOf": [
        # Each family's own keys come from its module (`ModelFamily.model_schema`).
        _when("family", name, {"properties": {**_MODEL_COMMON, **family.model_schema}, "additionalProperties": False})
        for name, family in FAMILIES.items()
    ],
}

_DATA = _object(
    "What to train on. Sharded by data-parallel rank; every rank reads disjoint samples.",
    {
        "type": _enum(
            list(KINDS),
            "What the data is (data/kinds/): text (raw text, tokenized once into a cached token file), tokens "
            "(token files already written: nanoGPT's flat .bin, Megatron/GPT-NeoX .bin/.idx), chat (conversations: "
            "records of messages) or instruction (prompt/completion pairs), rendered with a chat template, for GPT "
            "and Llama; image for ResNet; synthetic for any.",
        ),
        "path": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "null"},
            ],
            "description": "text: .txt/.json/.jsonl/.parquet file(s), a directory of such files (each .txt file one "
            "document) or a save_to_disk directory; null: the embedded default corpus. tokens: a flat .bin "
            "(nanoGPT) or a Megatron indexed dataset (its prefix, or its .bin beside its .idx); several are blended "
            "by data.weights. chat and instruction: .jsonl/.json/.parquet file(s) of records, a directory of them or a "
            "save_to_disk directory; null (chat): the project's chat sample, built from the embedded corpus. image: an "
            "imagefolder directory or a cifar-10-batches-py directory.",
            "default": None,
        },
        "validation_path": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                {"type": "null"},
            ],
            "description": "tokens, chat, instruction and streaming text: the held-out data, in the same form as "
            "data.path (nanoGPT's val.bin, say). null: tokens hold out the last data.validation_fraction of each file, "
            "chat and instruction the last data.validation_fraction of the conversations (or a save_to_disk folder's "
            "own validation split); streaming text needs it.",
            "default": None,
        },
        "tokenizer": {
            "type": "string",
            "description": '"char", "byte", or a local Hugging Face tokenizer directory. tokens: the tokenizer that '
            "wrote them, for the vocabulary and generation; a nanoGPT meta.pkl or this engine's meta.json beside "
            'the file supplies it where this stays "char". chat and instruction: "byte" (with data.chat_template) or '
            "a tokenizer directory, whose chat template renders the conversations.",
            "default": "char",
        },
        "cache_dir": {
            "type": "string",
            "description": "text, chat and instruction: where tokenized corpora are cached, one folder per corpus and "
            'tokenizer (and chat template). "auto": '
            "$DSENGINE_DATA_CACHE, else ~/.cache/dsengine/tokens (node-local: each node builds its own once). A "
            "folder on storage every node shares is built once for all.",
            "default": AUTO,
        },
        "cache_timeout_s": _integer(
            "text, chat and instruction: how long a process waits for another one (on this node, or sharing "
            "cache_dir) to finish "
            "tokenizing the corpus before it gives up with an error.",
            3600,
            minimum=1,
        ),
        "seq_len": _integer(
            "Input tokens per sample, each with the token after it as its label (so a sample is a window of "
            "seq_len + 1 tokens); chat and instruction: the most tokens of a conversation, or of a packed sample. "
            '"auto": the model\'s context (GPT n_positions, Llama max_position_embeddings).',
            AUTO,
            minimum=2,
            auto=True,
        ),
        "stride": _integer(
            'Text: tokens between the starts of consecutive training samples; "auto": seq_len, so every token '
            "is a target once per epoch. 1 starts a sample at every token, so shuffled batches draw windows at "
            "any offset as nanoGPT's random sampling does. Validation is always cut at stride seq_len.",
            AUTO,
            minimum=1,
            auto=True,
        ),
        "validation_fraction": _number(
            "Share held out for validation when the data has no validation split.", 0.1, exclusiveMinimum=0, maximum=0.5
        ),
        "image_size": _integer("Side of the square images fed to the model.", 32, minimum=8),
        "augment": _boolean("Random crop and horizontal flip for training images.", True),
        "mean": {
            "type": "array",
            "items": {"type": "number"},
            "minItems": 3,
            "maxItems": 3,
            "description": "Per-channel normalisation mean.",
            "default": [0.485, 0.456, 0.406],
        },
        "std": {
            "type": "array",
            "items": {"type": "number", "exclusiveMinimum": 0},
            "minItems": 3,
            "maxItems": 3,
            "description": "Per-channel normalisation standard deviation.",
            "default": [0.229, 0.224, 0.225],
        },
        "num_samples": _integer("Synthetic data: number of samples.", 1024, minimum=1),
        **kind_schema(),
        "num_workers": _integer(
            "DataLoader worker processes per rank; 0 loads in the training process (no extra cores on CPU).",
            0,
            minimum=0,
        ),
        "pin_memory": _boolean(
            "Batches in page-locked host memory, so their copy to the GPU runs asynchronously beside the step "
            '(the engine copies with non_blocking=True); "auto": on when training on a GPU.',
            AUTO,
            auto=True,
        ),
    },
    required=["type"],
)

_TRAINER = _object(
    "The training loop.",
    {
        "backend": _enum(
            ["auto", "deepspeed", "accelerate"],
            "Which library trains: DeepSpeed (ZeRO, offload, pipeline and tensor parallelism) or accelerate "
            '(DDP for ZeRO stage 0, torch FSDP2 for stages 2 and 3). "auto": accelerate when started by '
            "`accelerate launch` (unless its config yaml is a DeepSpeed plugin, which means DeepSpeed), DeepSpeed "
            "otherwise.",
            "auto",
        ),
        "max_steps": _integer(
            "Optimizer steps to run; 0 saves and exports the starting weights (model.init_from's, or a resumed "
            "checkpoint's) without training.",
            1000,
            minimum=0,
        ),
        "seed": _integer("Seeds model initialisation, data order and augmentation.", 1234, minimum=0),
        "output_dir": {
            "type": "string",
            "description": 'Where metrics, checkpoints, the resolved config and the export go; "auto": '
            "runs/<config file name>.",
            "default": AUTO,
        },
        "log_interval": _integer("Steps between logged metrics.", 10, minimum=1),
        "eval_interval": _integer("Steps between evaluations; 0: evaluate only at the end.", 0, minimum=0),
        "eval_batches": _integer(
            "Micro-batches per rank in one evaluation, read from the validation set in order. Where all ranks' "
            "batches need more samples than it has, it is read again to fill them, and the repeats count nothing.",
            8,
            minimum=1,
        ),
        "save_interval": _integer("Steps between checkpoints; 0: only at the end.", 0, minimum=0),
        "keep_checkpoints": _integer(
            "Newest published checkpoints to keep; older ones are deleted after each save. 0: keep all.",
            0,
            minimum=0,
        ),
        "async_save": _boolean(
            "Write checkpoints while training goes on: a save waits only for a copy of each rank's state in shared "
            "host memory (kept for the next save: one more copy of the rank's checkpointed states there), a writer "
            "process per rank writes it at idle CPU priority, and the checkpoint is published at a later step "
            "boundary once every rank's files are whole. DeepSpeed on every layout, through the engine's background "
            "checkpoint engine; accelerate through torch distributed checkpoint's async_save. Refused with "
            "checkpoint.writer (DeepSpeed's FastPersist engine).",
            False,
        ),
        "save_on_signal": _boolean(
            "On one of trainer.signals (to the launcher or to any rank), every rank agrees at the next step "
            "boundary to save a checkpoint and exit with code 75 (saved on preemption); evaluation in progress is "
            "cut short first. A second signal, or trainer.signal_grace_s after the first, ends the job at once "
            "(128 + the signal), the last good checkpoint intact (docs/failures.md).",
            True,
        ),
        "signals": {
            "type": "array",
            "items": {"type": "string"},
            "minItems": 1,
            "description": "Signal names that ask the run to save and exit: SIGTERM (a scheduler's preemption) and "
            "SIGUSR1 (what SLURM's --signal sends) by default.",
            "default": ["SIGTERM", "SIGUSR1"],
        },
        "signal_grace_s": _number(
            "Seconds from the first signal to an exit without saving, should the save not be done by then; "
            "under the bare deepspeed launcher its own 30 s to SIGKILL come first.",
            300.0,
            exclusiveMinimum=0,
        ),
        "max_wall_time": {
            "type": ["string", "null"],
            "description": 'A duration ("HH:MM:SS", "D-HH:MM:SS" as SLURM writes it, or "90m", "4h", "1h30m"): the '
            "run stops with a save and exit code 75 once the time left is less than the last save took plus one "
            "step, counted from the start of the ranks. null: no limit.",
            "default": None,
        },
        "resume": {
            "anyOf": [{"type": "boolean"}, {"type": "string"}],
            "description": "true: continue from the latest checkpoint in output_dir (an error if none); a "
            "path: continue from that checkpoint directory (or the latest in a checkpoints directory or a run's "
            "output_dir); false: start fresh.",
            "default": False,
        },
        "nonfinite": _enum(
            ["stop", "skip"],
            "A step whose loss or gradients are NaN/inf: stop the run there, before it is saved, naming the step "
            'and the last good checkpoint; or "skip" its update (weights and LR schedule unchanged), count it and '
            "go on. skip needs an optimizer that tests gradients: any accelerate layout, and DeepSpeed under "
            "ZeRO >= 1 or bf16/fp16, not fp32 ZeRO-0. fp16 overflows are the loss scaler's and never stop a run.",
            "stop",
        ),
        "max_skipped_steps": _integer(
            'Under nonfinite "skip": the run stops as under "stop" once more steps than this have been skipped '
            "(counted from the start of this process, fp16 overflows not included). 0: no limit.",
            10,
            minimum=0,
        ),
        "export": _boolean(
            "Write consolidated fp32 weights to <output_dir>/export at the end (under model.lora: peft's adapter "
            "directory, adapter_config.json and adapter_model.safetensors, on model.init_from's base).",
            True,
        ),
        "export_merge_lora": _boolean(
            "Under model.lora: the export is the base with the adapters merged into its weights (peft's "
            "merge_and_unload), a model AutoModelForCausalLM loads alone, instead of the adapter directory.",
            False,
        ),
        "sample_tokens": _integer(
            "GPT and Llama: tokens sampled from the export at the end (chat and instruction data: the reply to the "
            "first validation conversation's turns before its last answer, rendered through the chat template); "
            "0: none.",
            0,
            minimum=0,
        ),
        "progress_bar": _boolean("Rank 0 shows a progress bar.", True),
        "plots": _boolean(
            "Rank 0 draws the run's curves (loss, eval, lr, throughput, step time, memory per rank) as PNGs in "
            "<output_dir>/plots at the end; `python -m engine plot RUN_DIR` draws them at any time.",
            True,
        ),
        "peak_tflops": _number(
            "Dense peak TFLOP/s of one device at the run's precision, the denominator of the MFU in the "
            'metrics; "auto": from the engine\'s table of common GPUs (engine/launch/hardware.py), none on a CPU '
            "or an unknown device, where no MFU is reported.",
            "auto",
            auto=True,
            exclusiveMinimum=0,
        ),
        "comm_timeout_s": _number(
            "Seconds a rank may stay silent (dead, frozen, its node lost) or a collective may wait before "
            "every rank ends with an error naming the rank that failed; the job never hangs longer.",
            600.0,
            minimum=5,
        ),
        "compile": _boolean(
            "Compile the model with torch.compile (inductor). DeepSpeed compiles it through its engine's "
            "`compile()` (each stage's layers under pipeline parallelism); the accelerate backend compiles each "
            "FSDP unit (a GPT's or Llama's transformer blocks, a ResNet's four stages) before DDP or FSDP wraps it, as "
            "torchtitan does, and transformers' loss function. A decoder computes its loss in its forward, so "
            "DeepSpeed's whole-module compile holds it. The first steps pay the compilation.",
            False,
        ),
        "single_rank_fast_path": _boolean(
            "On one rank under DeepSpeed, with nothing offloaded and fp16 off, run what costs least for the same "
            "training: zero_optimization.stage 0 (ZeRO's partitioning, buckets and flattened copies buy nothing on one "
            "rank) and torch_autocast in place of bf16 (fp32 weights stepped by fused Adam, products in bf16, "
            "instead of DeepSpeed's bf16 wrapper and its per-tensor master copies). The start-up log names what it "
            "changed; resolved_config.json holds what ran. false: run the stage and precision as written.",
            True,
        ),
        "weight_decay_on": _enum(
            ["matrices", "all"],
            'Which parameters optimizer.params.weight_decay applies to. "matrices": those of two or more '
            "dimensions (linear, convolution and embedding weights); biases and LayerNorm/BatchNorm gains are "
            'exempt, as Megatron-LM, GPT-NeoX, nanoGPT and transformers\' Trainer exempt them. "all": every '
            "parameter, as a bare deepspeed.initialize(model.parameters()) decays them.",
            "matrices",
        ),
        "threads_per_rank": _integer(
            'CPU threads per rank; "auto": OMP_NUM_THREADS when set, else cores / local ranks.',
            AUTO,
            minimum=1,
            auto=True,
        ),
    },
    default={},
)

_PARALLEL = _object(
    "Model and sequence parallelism. Ranks are laid out pipeline-major, tensor-minor: data-parallel size = world "
    "size / (tensor x pipeline x sequence), and the ranks of one tensor-parallel group, or of one "
    "sequence-parallel group, are adjacent.",
    {
        "tensor_parallel_size": _integer(
            "Ranks that split each transformer layer (Megatron-style: attention by heads, key/value heads with "
            "them, MLP by width, embedding and head by vocabulary). Must divide the heads (GPT n_head; Llama "
            "num_attention_heads, num_key_value_heads and intermediate_size); ZeRO stage 0-2.",
            1,
            minimum=1,
        ),
        "pipeline_parallel_size": _integer(
            "Pipeline stages (DeepSpeed PipelineModule); the micro-batches of a step are "
            "gradient_accumulation_steps. ZeRO stage 0 or 1.",
            1,
            minimum=1,
        ),
        "pipeline_partition_method": _enum(
            ["parameters", "uniform", "type"],
            "How layers are split into stages: balance parameter counts, balance layer counts, or balance the "
            "family's repeating blocks (transformer blocks, residual blocks).",
            "parameters",
        ),
        "pipeline_activation_checkpoint_interval": _integer(
            "Recompute activations in the backward pass every this many pipeline layers; 0: keep them. "
            "Under pipeline parallelism this replaces model.activation_checkpointing.",
            0,
            minimum=0,
        ),
        "sequence_parallel_size": _integer(
            "Ranks that split each sequence (DeepSpeed's Ulysses, as Arctic Long Sequence Training runs it): "
            "outside attention each rank holds data.seq_len / this many tokens of every sequence, inside it "
            "all-to-alls give each rank the whole sequence for heads / this many of the attention heads, so "
            "activation memory per rank falls with it. Each group of this many adjacent ranks reads one "
            "data-parallel replica's batches; ZeRO partitions the model states over all the ranks (data x "
            "sequence). The Llama family only; must divide data.seq_len (text, tokens and synthetic data; "
            "conversations are padded to a multiple of it) and num_attention_heads, and divide or be a "
            "multiple of num_key_value_heads. Needs sdpa "
            "attention, the DeepSpeed backend, tensor and pipeline parallelism at 1, data.packing false (the "
            "attention sees no boundary between packed conversations), and under ZeRO-3 "
            "zero_optimization.reduce_scatter true. DeepSpeed's top-level sequence_parallel_size is read as it.",
            1,
            minimum=1,
        ),
    },
    default={},
)

ENGINE_SECTIONS = ("model", "data", "trainer", "parallel")

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://github.com/dsengine/engine/config.schema.json",
    "title": "Engine config",
    "description": "One JSON file: DeepSpeed's keys at the top level, the engine's in model, data, trainer, parallel.",
    "type": "object",
    "properties": {
        **DEEPSPEED_PROPERTIES,
        "model": _MODEL,
        "data": _DATA,
        "trainer": _TRAINER,
        "parallel": _PARALLEL,
    },
    "required": ["model", "data"],
    "additionalProperties": False,
}
