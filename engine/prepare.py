"""Everything a run's inputs can get wrong, checked before any process group exists: the config
(validated and resolved), the launcher against it, the data, the vocabulary and classes the model
needs from the data, the checkpoint to resume and the weights to start from. A failure here is a
`ConfigError` or `RunError`: one message, exit code 2, on every rank."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from data import DataBundle, batches_per_epoch, build_datasets
from data.tokens.external import check_ids_below
from engine.checkpoints.export import base_model
from engine.checkpoints.integrity import check_intact
from engine.checkpoints.nvme import resume_problem
from engine.checkpoints.reshape import CheckpointManifest, needs_conversion, read_manifest
from engine.checkpoints.store import CheckpointRef, published_tags, resume_target
from engine.config import ConfigError, ConfigIssue, EngineConfig, load_config
from engine.config.rules import exempts_vectors
from engine.config.stop_settings import StopSettings
from engine.failures.faults import fault_from_env
from engine.failures.preemption import estimated_save_s
from engine.launch.deepspeed_plugin import deepspeed_plugin_problems, deepspeed_plugin_settings
from engine.launch.detect import launch_problems
from engine.launch.hardware import Hardware, detect_hardware
from engine.launch.nvme import nvme_paths, nvme_problems
from engine.launch.ops import prepare_ops
from engine.parallel.layout import parallel_layout
from engine.parallel.process_group import env_world_size
from engine.run_description import RunDescription
from models import get_family
from models.lora import target_problems
from models.module_state import count_parameters


class RunError(Exception):
    """A problem with the inputs of a run (not a bug): printed as one message, exit code 2."""


def load_data(config: EngineConfig) -> DataBundle:
    """The config's datasets, checked to fill one global batch; a data problem is one RunError."""
    try:
        bundle = build_datasets(
            config.data.as_mapping(),
            samples=get_family(config.model.family).samples,
            seed=config.trainer.seed,
            seq_len=config.data.seq_len,
            vocab_size=None if config.model.fields.get("vocab_size", "auto") == "auto" else config.model.vocab_size,
            num_classes=config.model.num_classes,
        )
        # The sampler's own check, here rather than in the first step, after every process group.
        if not bundle.streamed:
            batches_per_epoch(len(bundle.train), config.batch.train_batch_size)
    except (ValueError, FileNotFoundError) as error:
        raise RunError(f"data error: {error}") from None
    return bundle


def settle_vocabulary(config: EngineConfig, bundle: DataBundle, saved_vocab_size: int | None = None) -> EngineConfig:
    """Give the model the tokenizer's vocabulary, or refuse a vocabulary that cannot hold it.

    A resumed run keeps the vocabulary of the checkpoint (`saved_vocab_size`), which "auto" may
    have padded for another tensor-parallel degree. Token files are checked id by id (their largest
    id, scanned once and cached): a file another tokenizer wrote can hold ids beyond its own."""
    configured = config.model.fields.get("vocab_size", "auto")
    if bundle.vocab_size is None and bundle.token_files and configured == "auto" and saved_vocab_size is None:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.vocab_size",
                    '"auto" takes the tokenizer\'s vocabulary, and the token files name none (no meta.pkl or meta.json '
                    "beside them); set it to the vocabulary of the tokenizer that wrote them, or name that tokenizer "
                    "in data.tokenizer",
                )
            ],
            str(config.source),
        )
    if bundle.vocab_size is not None:
        config = config.with_vocab_size(max(bundle.vocab_size, saved_vocab_size or 0))
        if config.model.vocab_size < bundle.vocab_size:
            raise ConfigError([_vocabulary_overflow(config, bundle.vocab_size)], str(config.source))
    elif saved_vocab_size is not None and configured == "auto":
        config = config.with_vocab_size(saved_vocab_size)
    if bundle.token_files:
        try:
            check_ids_below(bundle.token_files, config.model.vocab_size, cache_dir=_cache_dir(config))
        except ValueError as error:
            raise RunError(f"data error: {error}") from None
    return config


def _vocabulary_overflow(config: EngineConfig, tokens: int) -> ConfigIssue:
    """A tokenizer of `tokens` ids, more than the model has embedding rows: fixed by the vocabulary
    where the config sets it, by the tokenizer where a pretrained directory does."""
    if config.model.init_from is not None and get_family(config.model.family).pretrained_fields is not None:
        return ConfigIssue(
            "data.tokenizer",
            f'"{config.data.tokenizer}" has {tokens} tokens, more than the {config.model.vocab_size} embedding rows '
            f"of model.init_from {config.model.init_from} (its config.json's vocab_size); use the tokenizer that "
            "model was trained with",
        )
    return ConfigIssue(
        "model.vocab_size",
        f"{config.model.vocab_size} is smaller than the tokenizer's {tokens} tokens "
        f'(data.tokenizer "{config.data.tokenizer}"); raise it or use "auto"',
    )


def _cache_dir(config: EngineConfig) -> Path | None:
    return Path(config.data.cache_dir) if config.data.cache_dir != "auto" else None


def check_classes(config: EngineConfig, bundle: DataBundle) -> None:
    """Refuse a classifier with fewer outputs than the data has classes: its loss would fail in the
    first forward (on a GPU as a device-side assert), after every process group had started."""
    if bundle.num_classes is None or config.model.num_classes >= bundle.num_classes:
        return
    raise ConfigError(
        [
            ConfigIssue(
                "model.num_classes",
                f"{config.model.num_classes} is fewer than the {bundle.num_classes} classes of the data "
                f'(data.type "{config.data.type}"); raise it to at least {bundle.num_classes}',
            )
        ],
        str(config.source),
    )


def check_data(config: EngineConfig) -> tuple[EngineConfig, DataBundle]:
    """What `prepare` checks of the data, for `validate` and `plan` to check it as a launch would:
    the files load and fill one global batch, and the model's vocabulary and classes hold the
    data's. The config comes back with its vocabulary settled, beside the data (whose memory `plan`
    counts)."""
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    check_classes(config, bundle)
    check_lora_targets(config)
    return config, bundle


def check_lora_targets(config: EngineConfig) -> None:
    """model.lora's target_modules and modules_to_save, each matched against the modules of the model
    (built on the meta device, its vocabulary settled): a name that matches none is one ConfigError
    naming the model's layers, where peft would refuse only a list none of whose names match."""
    section = config.model.fields.get("lora")
    if section is None or not get_family(config.model.family).lora:
        return
    base = base_model(get_family(config.model.family), config.model.fields, weights=False)
    problems = target_problems(base, section)
    if problems:
        issues = [ConfigIssue(f"model.lora.{key}", message) for key, message in problems]
        raise ConfigError(issues, str(config.source))


def prepare(config_path: str, overrides: list[str]) -> RunDescription:
    """Everything that can fail because of user input, done before any process group exists; the
    run as it will be, settled once (engine/run_description.py)."""
    hardware = detect_hardware()
    config = load_config(config_path, overrides, world_size=env_world_size(), hardware=hardware)
    check_launch(config, config_path)
    torch.set_num_threads(config.trainer.threads_per_rank)
    bundle = load_data(config)
    try:
        resume = resume_target(config.trainer.resume, config.trainer.output_path)
        check_steps_left(resume, config.trainer.max_steps)
        saved = read_manifest(resume.path) if resume else None
        if saved is not None and config.rerouted and saved.zero_stage != config.zero_stage:
            config = keep_configured_stage(config, resume, saved)
        if resume is not None:
            others = [tag for tag in reversed(published_tags(resume.root)) if tag != resume.tag]
            check_intact(resume.path, saved, others)
        config = settle_vocabulary(config, bundle, saved.vocab_size if saved is not None else None)
        check_classes(config, bundle)
        get_family(config.model.family).check_init_from(config.model.fields)
        check_lora_targets(config)
        manifest = checkpoint_manifest(config, bundle)
        reshape = resume is not None and needs_conversion(saved, manifest, resume.path)
        if resume is not None:
            check_nvme_resume(config, resume, reshape)
        fault = fault_from_env()
        stops = StopSettings.from_trainer(config.trainer)
        parameters = check_wall_time(config, stops)
        check_nvme(config, hardware)
        prepare_ops(config.document, hardware.device_type)  # last: it may build for minutes
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise RunError(str(error)) from None
    deepspeed_config = config.deepspeed_config()
    if reshape:
        # DeepSpeed must know at initialisation that it loads its optimizer from a universal checkpoint.
        deepspeed_config["checkpoint"] = {"load_universal": True}
    return RunDescription(
        config=config,
        data=bundle,
        hardware=hardware,
        batch=config.batch,
        layout=parallel_layout(config),
        stops=stops,
        vocab_size=manifest.vocab_size,
        deepspeed_config=deepspeed_config,
        resume=resume,
        saved_manifest=saved,
        manifest=manifest,
        reshape=reshape,
        fault=fault,
        parameters=parameters,
    )


def check_wall_time(config: EngineConfig, stops: StopSettings) -> int:
    """The model's parameter count where trainer.max_wall_time is set (0 elsewhere), after refusing a
    limit shorter than one save of the model (its checkpointed bytes at a conservative write rate):
    such a run would stop before its first step. Counted on the meta device: nothing is allocated."""
    if stops.wall_time_s is None:
        return 0
    family = get_family(config.model.family)
    with torch.device("meta"):
        parameters = count_parameters(family.build(config.model.fields))
    save_s = estimated_save_s(parameters)
    if stops.wall_time_s <= save_s:
        raise ValueError(
            f"trainer.max_wall_time {config.trainer.max_wall_time!r} is shorter than one save of this model "
            f"(about {save_s:.0f} s for {parameters:,} parameters); allow more time"
        )
    return parameters


def check_nvme(config: EngineConfig, hardware: Hardware) -> None:
    """ZeRO-Infinity's folders and buffers, checked on this node before its ranks start: each
    nvme_path writable, taking direct I/O and with room for the swap files `plan` counts; the swap
    buffers within what this user may page-lock; and every swapped parameter partition within
    offload_param.buffer_size, which DeepSpeed asserts only when it first swaps it in."""
    if not nvme_paths(config.document):
        return
    from engine.plan import nvme_bytes, plan_run  # the planner, only where a run swaps to NVMe
    from engine.plan.planner import zero_settings

    plan = plan_run(config, hardware)
    problems = nvme_problems(config.document, nvme_bytes(plan), max(rank.states.host_buffers for rank in plan.ranks))
    zero = config.document["zero_optimization"]
    if zero["offload_param"]["device"] == "nvme":
        family = get_family(config.model.family)
        with torch.device("meta"):
            sizes = [parameter.numel() for parameter in family.build(config.model.fields).parameters()]
        largest = math.ceil(max(sizes) / parallel_layout(config).data)
        # The planner's reading of the swap settings: DeepSpeed's defaults and its smallest swap.
        swap = zero_settings(config, hardware.device_type == "cuda").swap
        buffer_size = swap.param_buffer_size
        swapped = largest * (4 if config.precision == "fp32" else 2) >= swap.min_aio_bytes
        if swapped and largest > buffer_size:
            problems.append(
                f"zero_optimization.offload_param.buffer_size: {buffer_size} elements is less than this model's "
                f"largest parameter partition, {largest}, which DeepSpeed swaps through one buffer: raise it to at "
                f"least {largest}"
            )
    if problems:
        raise ValueError("NVMe offload: " + "\n  ".join(problems))


def check_nvme_resume(config: EngineConfig, resume: CheckpointRef, reshape: bool) -> None:
    """A checkpoint whose optimizer states are in NVMe swap files resumes only as it was saved."""
    swaps = config.document["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    problem = resume_problem(resume.path, swaps, reshape)
    if problem:
        raise ValueError(f"trainer.resume: {problem}")


def check_launch(config: EngineConfig, config_path: str) -> None:
    """The launcher's own settings against the config: one RunError naming every disagreement.

    accelerate's DeepSpeed plugin is held to the config as written: the ZeRO stage 0 and autocast
    that `trainer.single_rank_fast_path` runs one rank in are the engine's choice, not the config's."""
    problems = launch_problems(config.trainer.backend, config.precision, config.world_size, Path(config_path))
    plugin = deepspeed_plugin_settings()
    if plugin is not None:
        written = config.as_configured
        problems += deepspeed_plugin_problems(
            plugin, Path(config_path), written.trainer.backend, written.precision, written.document
        )
    if problems:
        raise RunError("launch error:\n  " + "\n  ".join(problems))


def keep_configured_stage(config: EngineConfig, resume: CheckpointRef, saved: CheckpointManifest) -> EngineConfig:
    """The config as written, for a one-rank resume of a checkpoint saved under ZeRO-1/2/3: DeepSpeed
    loads such a checkpoint into a ZeRO stage only (its universal form holds partitioned optimizer
    states), so `trainer.single_rank_fast_path` must not turn the stage into 0."""
    reason = (
        f"one rank, but checkpoint {resume.path} was saved under ZeRO-{saved.zero_stage}, which loads into a "
        "ZeRO stage only: the stage and precision stay as configured"
    )
    return dataclasses.replace(config.as_configured, rerouted=reason)


def check_steps_left(resume: CheckpointRef | None, max_steps: int) -> None:
    """A checkpoint past `trainer.max_steps` would load, train nothing and export it as it was."""
    step = resume.step if resume is not None else None
    if step is not None and step > max_steps:
        raise RunError(
            f"trainer.max_steps: {max_steps} is below step {step} of checkpoint {resume.path}; raise it "
            f"to train on, or set it to {step} to export the checkpoint as it is"
        )


def checkpoint_manifest(config: EngineConfig, bundle: DataBundle) -> CheckpointManifest:
    """The record every checkpoint of this run keeps (`engine.checkpoints.reshape.CheckpointManifest`)."""
    layout = parallel_layout(config)

    vocab_size = config.model.vocab_size if get_family(config.model.family).uses_vocabulary else None
    groups = 2 if exempts_vectors(config.document["optimizer"], config.trainer.weight_decay_on) else 1
    tokenizer = bundle.tokenizer.fingerprint if bundle.tokenizer is not None else None
    streamed = bundle.streamed
    return CheckpointManifest(
        config.trainer.backend,
        layout.data,
        layout.pipeline,
        layout.tensor,
        config.zero_stage,
        vocab_size,
        groups,
        tokenizer,
        config.batch.train_batch_size,
        None if streamed else len(bundle.train),
        streamed,
        lora=config.model.fields.get("lora") is not None,
        sequence=layout.sequence,
    )
