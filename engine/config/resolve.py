"""Turning a valid config into the one the engine runs: every `"auto"` replaced by a value, the
batch triple solved, and the DeepSpeed part split out.

HF-Trainer-style `"auto"` values are resolved from the engine's own settings here rather than
passed through, so the resolved config written to the output directory says exactly what ran.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from data.tokens.cache import default_cache_dir
from engine.config.batch import BatchTriple, solve_document_batch
from engine.config.rules import ACCELERATE_WRAPPERS, auto_bf16, auto_fp16, auto_torch_adam, data_parallel_size, offloads
from engine.config.schema import AUTO, DEEPSPEED_PROPERTIES
from engine.config.sections import DataSection, ModelSection, ParallelSection, TrainerSection, typed_section
from engine.config.validate import schema_at
from engine.launch.deepspeed_plugin import PLUGIN_TO_CONFIG, deepspeed_plugin_settings
from engine.launch.detect import effective_backend
from engine.launch.hardware import Hardware, device_peak_flops
from models import get_family
from models.tile_sizes import tiled_loss_pieces

# Megatron-LM's smallest gradient bucket; DeepSpeed's ZeRO-3 prefetch and persistence defaults.
_REDUCE_BUCKET_FLOOR = 40_000_000
_PREFETCH_BUCKET_DEFAULT = 50_000_000
_PERSISTENCE_THRESHOLD_DEFAULT = 100_000
# DeepSpeed's WarmupLR raises a shorter warm-up to 2 steps (its log warm-up divides by log(steps)).
_FEWEST_WARMUP_STEPS = 2


@dataclass(frozen=True)
class EngineConfig:
    """A validated, resolved config: `document` is the whole of it, as resolved_config.json records it;
    the engine's own sections are typed views of it (engine/config/sections.py)."""

    document: dict[str, Any]
    world_size: int
    source: Path | None = field(default=None, compare=False)
    # What `trainer.single_rank_fast_path` changed, as the start-up log names it ("" where nothing).
    rerouted: str = field(default="", compare=False)
    # One line per deprecated DeepSpeed spelling, or DeepSpeed spelling of an engine key, the config
    # used, naming the key it was read as.
    notices: tuple[str, ...] = field(default=(), compare=False)
    # The same document resolved without the single-rank route, where `rerouted` says it changed something.
    unrouted: EngineConfig | None = field(default=None, compare=False, repr=False)

    @property
    def as_configured(self) -> EngineConfig:
        """The config with its ZeRO stage and precision as written: what accelerate's plugin is held to,
        and what a one-rank resume of a ZeRO-1/2/3 checkpoint runs (engine/describe.py)."""
        return self.unrouted if self.unrouted is not None else self

    @cached_property
    def batch(self) -> BatchTriple:
        """The solved batch triple (engine/config/batch.py), read by name rather than by DeepSpeed's keys."""
        doc = self.document
        return BatchTriple(
            doc["train_batch_size"], doc["train_micro_batch_size_per_gpu"], doc["gradient_accumulation_steps"]
        )

    @cached_property
    def model(self) -> ModelSection:
        return ModelSection.from_document(self.document["model"])

    @cached_property
    def data(self) -> DataSection:
        return typed_section(DataSection, self.document["data"])

    @cached_property
    def trainer(self) -> TrainerSection:
        return typed_section(TrainerSection, self.document["trainer"])

    @cached_property
    def parallel(self) -> ParallelSection:
        return typed_section(ParallelSection, self.document["parallel"])

    @property
    def dp_size(self) -> int:
        return data_parallel_size(self.document, self.world_size)

    @property
    def zero_stage(self) -> int:
        return self.document["zero_optimization"]["stage"]

    @property
    def accelerate_wrapper(self) -> str | None:
        """What the ZeRO stage means under the accelerate backend: "ddp", "fsdp_grad_op" or "fsdp_full";
        None for stage 1, which FSDP has no equivalent of (refused under that backend)."""
        return ACCELERATE_WRAPPERS.get(self.zero_stage)

    @property
    def precision(self) -> str:
        """The weights' dtype in training: fp32 under torch_autocast, whose products alone are bf16."""
        if self.document["bf16"]["enabled"]:
            return "bf16"
        return "fp16" if self.document["fp16"]["enabled"] else "fp32"

    @property
    def autocast(self) -> bool:
        return self.document["torch_autocast"]["enabled"]

    @property
    def precision_label(self) -> str:
        """The run's precision as its logs name it."""
        return "bf16 torch_autocast (fp32 weights)" if self.autocast else self.precision

    @property
    def compute_precision(self) -> str:
        """The dtype of the matrix products: what the device's peak FLOP/s and activations are counted in."""
        return "bf16" if self.autocast else self.precision

    def deepspeed_config(self) -> dict[str, Any]:
        """The DeepSpeed keys only, as `deepspeed.initialize(config=...)` takes them. `fused: false` stays in
        the document (resolved_config.json holds what ran) but is not handed on: torch reads fused=False
        as "no foreach either" (torch/optim/adam.py), and DeepSpeed's own Adams take no such argument.
        Under sequence parallelism DeepSpeed's top-level `sequence_parallel_size` carries the degree: its
        batch arithmetic counts world size / SP data-parallel ranks by it."""
        config = {key: copy.deepcopy(value) for key, value in self.document.items() if key in DEEPSPEED_PROPERTIES}
        params = config.get("optimizer", {}).get("params", {})
        if params.get("fused") is False:
            del params["fused"]
        if self.parallel.sequence_parallel_size > 1:
            config["sequence_parallel_size"] = self.parallel.sequence_parallel_size
        return config

    def with_vocab_size(self, vocab_size: int) -> EngineConfig:
        """Settle `model.vocab_size: "auto"` once the tokenizer is known (it is built from the data),
        rounded up so the embedding splits evenly across the tensor-parallel ranks; the extra rows
        are never a target, so training only learns to keep their logits low."""
        if self.document["model"].get("vocab_size", AUTO) != AUTO:
            return self
        degree = self.parallel.tensor_parallel_size
        document = copy.deepcopy(self.document)
        document["model"]["vocab_size"] = -(-vocab_size // degree) * degree
        _resolve_loss(document)
        unrouted = None if self.unrouted is None else self.unrouted.with_vocab_size(vocab_size)
        return EngineConfig(document, self.world_size, self.source, self.rerouted, self.notices, unrouted)

    def with_notices(self, notices: tuple[str, ...]) -> EngineConfig:
        unrouted = None if self.unrouted is None else self.unrouted.with_notices(notices)
        return dataclasses.replace(self, notices=notices, unrouted=unrouted)


def resolve(document: dict, world_size: int, hardware: Hardware, source: Path | None = None) -> EngineConfig:
    """Replace every "auto" in a valid, defaults-filled document (except the model's vocabulary
    size, which waits for the tokenizer). Where `trainer.single_rank_fast_path` reroutes one rank, the
    document is also resolved as written, once, beside it (`EngineConfig.as_configured`)."""
    config = _resolved(document, world_size, hardware, source)
    if not config.rerouted:
        return config
    written = copy.deepcopy(document)
    written["trainer"]["single_rank_fast_path"] = False
    return dataclasses.replace(config, unrouted=_resolved(written, world_size, hardware, source))


def _resolved(document: dict, world_size: int, hardware: Hardware, source: Path | None) -> EngineConfig:
    doc = copy.deepcopy(document)
    _resolve_batch(doc, world_size)
    _resolve_precision(doc, hardware)
    rerouted = _single_rank_route(doc, world_size)
    _resolve_optimizer(doc, hardware)
    family = get_family(doc["model"]["family"])
    architecture = family.architecture(doc["model"])
    # ZeRO reduces over every rank holding a copy of the weights: each data replica's sequence shards too.
    zero_ranks = data_parallel_size(doc, world_size) * doc["parallel"]["sequence_parallel_size"]
    _resolve_zero_buckets(doc["zero_optimization"], family.hidden_size(architecture), zero_ranks)
    if doc["gradient_clipping"] == AUTO:
        doc["gradient_clipping"] = 1.0
    if doc["data"]["seq_len"] == AUTO:
        doc["data"]["seq_len"] = family.context_length(architecture)
    if doc["data"]["stride"] == AUTO:
        doc["data"]["stride"] = doc["data"]["seq_len"]
    if doc["data"]["cache_dir"] == AUTO:
        doc["data"]["cache_dir"] = str(default_cache_dir())
    if doc["data"]["pin_memory"] == AUTO:
        doc["data"]["pin_memory"] = hardware.device_type == "cuda"
    trainer = doc["trainer"]
    trainer["backend"] = effective_backend(trainer["backend"])
    _resolve_loss(doc)
    if trainer["output_dir"] == AUTO:
        trainer["output_dir"] = str(Path("runs") / (source.stem if source else "default"))
    for monitor in ("tensorboard", "csv_monitor"):
        if doc[monitor]["output_path"] == AUTO:
            # DeepSpeed's default ("") writes beside the working directory, apart from the run.
            doc[monitor]["output_path"] = str(Path(trainer["output_dir"]) / "monitor")
    if trainer["threads_per_rank"] == AUTO:
        # The deepspeed launcher does not set OMP_NUM_THREADS; without this every rank would
        # start one thread per core and the ranks of a node would fight over them.
        trainer["threads_per_rank"] = hardware.omp_num_threads or max(
            1, hardware.cpu_count // max(1, hardware.local_world_size)
        )
    if trainer["peak_tflops"] == AUTO:
        config = EngineConfig(doc, world_size, source)
        peak = device_peak_flops(hardware.name, config.compute_precision)
        trainer["peak_tflops"] = None if peak is None else peak / 1e12
    return EngineConfig(doc, world_size, source, rerouted)


def _resolve_loss(doc: dict) -> None:
    """A decoder's `model.loss: "auto"` once its vocabulary is known: "fused" where the head is whole
    on its rank (no ZeRO-3, FSDP, tensor or pipeline split) and a micro-batch's longest fp32 logits
    span more than one piece, so that it holds less; "full" otherwise (models/tiling.py)."""
    model, parallel = doc["model"], doc["parallel"]
    if model.get("loss") != AUTO or model.get("vocab_size", AUTO) == AUTO:
        return
    if doc["trainer"]["backend"] == "accelerate":
        sharded = ACCELERATE_WRAPPERS.get(doc["zero_optimization"]["stage"]) != "ddp"
    else:
        sharded = doc["zero_optimization"]["stage"] == 3
    split = parallel["tensor_parallel_size"] > 1 or parallel["pipeline_parallel_size"] > 1
    tokens = doc["train_micro_batch_size_per_gpu"] * doc["data"]["seq_len"] // parallel["sequence_parallel_size"]
    fused = not sharded and not split and tiled_loss_pieces(tokens, model["vocab_size"]) > 1
    model["loss"] = "fused" if fused else "full"


def settle_training_arguments(document: dict) -> dict:
    """A copy of a defaults-filled document with HF's TrainingArguments "auto" values settled: the
    cross-field rules compare them. HF's Trainer fills these from TrainingArguments; the engine has
    none, so each takes its key's default in the schema, and the warm-up is 1% of the run (at least
    the 2 steps DeepSpeed runs), Megatron-LM's --lr-warmup-fraction 0.01."""
    doc = copy.deepcopy(document)
    optimizer = doc["optimizer"]
    defaults = schema_at(["optimizer", "params"], doc)["properties"]
    for key in ("lr", "betas", "eps", "weight_decay"):
        if optimizer["params"].get(key) == AUTO:
            optimizer["params"][key] = copy.deepcopy(defaults[key]["default"])
    scheduler = doc.get("scheduler")
    if scheduler:
        params = scheduler["params"]
        if params.get("warmup_min_lr") == AUTO:
            params["warmup_min_lr"] = schema_at(["scheduler", "params", "warmup_min_lr"], doc)["default"]
        if params.get("warmup_num_steps") == AUTO:
            params["warmup_num_steps"] = max(_FEWEST_WARMUP_STEPS, doc["trainer"]["max_steps"] // 100)
    return doc


def settle_plugin_values(document: dict) -> dict:
    """A copy of a defaults-filled document with the "auto" values accelerate's DeepSpeed plugin fills
    (its DeepSpeedPlugin's own map, engine/launch/deepspeed_plugin.py) taken from the yaml the run was
    launched with, or from the engine's defaults without one: ZeRO stage 0, no offload, no 16-bit
    copy at ZeRO-3 saves. The accumulation and clipping keep their own "auto" rules where the yaml
    is silent."""
    doc = copy.deepcopy(document)
    plugin = deepspeed_plugin_settings()
    fallbacks = {
        "zero_optimization.stage": 0,
        "zero_optimization.offload_optimizer.device": "none",
        "zero_optimization.offload_param.device": "none",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
    }
    for field_name, dotted in PLUGIN_TO_CONFIG.items():
        *parents, key = dotted.split(".")
        section = doc
        for parent in parents:
            section = section[parent]
        if section.get(key) != AUTO:
            continue
        given = getattr(plugin, field_name) if plugin is not None else None
        section[key] = fallbacks[dotted] if given is None else given
    return doc


def _resolve_batch(doc: dict, world_size: int) -> None:
    triple = solve_document_batch(doc, data_parallel_size(doc, world_size))
    doc["train_batch_size"] = triple.train_batch_size
    doc["train_micro_batch_size_per_gpu"] = triple.micro_batch_size
    doc["gradient_accumulation_steps"] = triple.gradient_accumulation_steps


def _resolve_precision(doc: dict, hardware: Hardware) -> None:
    autocast = doc["torch_autocast"]["enabled"]  # the mixed precision asked for: "auto" picks no other
    if doc["bf16"]["enabled"] == AUTO:
        doc["bf16"]["enabled"] = auto_bf16(doc, hardware)
        if doc["bf16"]["enabled"] and _autocasts_instead(doc):
            # Without ZeRO, DeepSpeed's bf16 wrapper reads every gradient back to the host at each
            # step (148 reads for GPT-2, benchmark 8); torch_autocast is the same bf16 products
            # over fp32 weights, without the wrapper.
            doc["bf16"]["enabled"], doc["torch_autocast"]["enabled"] = False, True
            autocast = True
    if doc["fp16"]["enabled"] == AUTO:
        doc["fp16"]["enabled"] = not autocast and auto_fp16(doc, hardware, doc["bf16"]["enabled"])
    if doc["bf16"]["check_grad_overflow"] == AUTO:
        doc["bf16"]["check_grad_overflow"] = doc["trainer"]["nonfinite"] == "skip"
    if doc["data_types"]["buffer_dtype"] == AUTO:
        mixed = "bf16" if doc["bf16"]["enabled"] else "fp16" if doc["fp16"]["enabled"] else None
        doc["data_types"]["buffer_dtype"] = mixed


def _autocasts_instead(doc: dict) -> bool:
    """Where bf16 "auto" means torch_autocast: ZeRO stage 0 on DeepSpeed's whole-model engine."""
    return (
        doc["zero_optimization"]["stage"] == 0
        and doc["parallel"]["pipeline_parallel_size"] == 1
        and effective_backend(doc["trainer"]["backend"]) == "deepspeed"
    )


def _single_rank_route(doc: dict, world_size: int) -> str:
    """`trainer.single_rank_fast_path`: on one DeepSpeed rank with nothing offloaded and not under fp16,
    ZeRO stage 0 and torch_autocast in place of bf16. Returns what it changed, for the start-up log.

    The arithmetic is the same where it can be: Adam on fp32 masters, the same clipping; under bf16
    the products are bf16 either way, and autocast keeps the rest (norms, softmax, residuals) in fp32
    where DeepSpeed's bf16 runs them in bf16. Measured in docs/benchmarks.md (hostcost, optimizer)."""
    zero = doc["zero_optimization"]
    offloaded = offloads(zero)
    # "skip" needs DeepSpeed's ZeRO or mixed-precision optimizer, which drops an update with NaN gradients.
    skip = doc["trainer"]["nonfinite"] == "skip"
    # fp16 keeps its stage: its loss scaler, masters and checkpoint are the stage's own, and no
    # autocast stands in for it as torch_autocast stands in for bf16.
    fp16 = doc["fp16"]["enabled"]
    if not doc["trainer"]["single_rank_fast_path"] or world_size != 1 or offloaded or skip or fp16:
        return ""
    if effective_backend(doc["trainer"]["backend"]) != "deepspeed":
        return ""
    changes = []
    if zero["stage"] != 0:
        changes.append(f"zero_optimization.stage {zero['stage']} runs as 0")
        zero["stage"] = 0
    if doc["bf16"]["enabled"]:
        changes.append("bf16 runs as torch_autocast (fp32 weights, bf16 products)")
        doc["bf16"]["enabled"] = False
        doc["torch_autocast"]["enabled"] = True
        doc["data_types"]["buffer_dtype"] = None
    return "one rank, nothing to shard: " + "; ".join(changes) if changes else ""


def _resolve_optimizer(doc: dict, hardware: Hardware) -> None:
    """The optimizer's "auto"s: torch's Adam wherever DeepSpeed would build FusedAdam (no compiler on
    the default route, docs/design/config.md), its fused kernel where it steps parameters on a GPU; then the
    schedule's, from the optimizer and the run."""
    params = doc["optimizer"]["params"]
    if params.get("torch_adam") == AUTO:
        params["torch_adam"] = auto_torch_adam(doc)
    if params.get("torch_adam") is True:
        params.pop("bias_correction", None)  # torch's Adam takes no such argument and always corrects
    if params.get("fused") == AUTO:
        params["fused"] = hardware.device_type == "cuda" and _torch_adam_steps_on_device(doc)
    scheduler = doc.get("scheduler")
    if not scheduler:
        return
    if scheduler["params"].get("warmup_max_lr") == AUTO:
        scheduler["params"]["warmup_max_lr"] = params["lr"]
    if scheduler["params"].get("total_num_steps") == AUTO:
        scheduler["params"]["total_num_steps"] = max(1, doc["trainer"]["max_steps"])


def _torch_adam_steps_on_device(doc: dict) -> bool:
    """Whether torch's Adam runs and steps parameters where the model is: under DeepSpeed, torch_adam
    without optimizer offload; under the accelerate backend (always torch's Adam), nothing offloaded,
    since FSDP2's CPUOffloadPolicy moves parameters and optimizer to the host for either key."""
    zero = doc["zero_optimization"]
    if effective_backend(doc["trainer"]["backend"]) == "accelerate":
        return not offloads(zero)
    return doc["optimizer"]["params"].get("torch_adam") is True and zero["offload_optimizer"]["device"] == "none"


def _resolve_zero_buckets(zero: dict, hidden: int | None, data_parallel: int) -> None:
    """ZeRO's buckets at Megatron-LM's size, never smaller than a tensor of GPT-2 124M's: a gradient
    bucket of max(40M, 1M x data-parallel ranks) elements (Megatron's `bucket_size`), and ZeRO-3
    prefetching DeepSpeed's 5e7. HF's n_embd^2 bucket (589,824 for GPT-2 124M) is smaller than every
    matrix of the model, so ZeRO-2 reduced one tensor per collective: 102 all-reduces a step on two
    ranks, against 6 at 40M (docs/design/parallelism.md). Parameters under 10 x the width stay whole under
    ZeRO-3, as HF sizes them: each would cost a gather for a few kB."""
    defaults = {
        "reduce_bucket_size": max(_REDUCE_BUCKET_FLOOR, 1_000_000 * data_parallel),
        "stage3_prefetch_bucket_size": _PREFETCH_BUCKET_DEFAULT,
        "stage3_param_persistence_threshold": 10 * hidden if hidden else _PERSISTENCE_THRESHOLD_DEFAULT,
    }
    for key, value in defaults.items():
        if zero[key] == AUTO:
            zero[key] = value
