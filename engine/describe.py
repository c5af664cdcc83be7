"""Everything a run's inputs can get wrong, checked before any process group exists: the config
(validated and resolved), the launcher against it, the data, the vocabulary and classes the model
needs from the data (engine/preflight.py, which `validate` and `plan` share), the checkpoint to resume
and the weights to start from. A failure here is a `ConfigError` or `RunError`: one message, exit code
2, on every rank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from data import DataBundle
from engine.checkpoints.integrity import check_intact
from engine.checkpoints.nvme import resume_problem
from engine.checkpoints.reshape import CheckpointManifest, needs_conversion, read_manifest
from engine.checkpoints.store import CheckpointRef, published_tags, resume_target
from engine.config import EngineConfig, load_config
from engine.config.rules import exempts_vectors
from engine.config.stop_settings import StopSettings
from engine.failures.faults import fault_from_env
from engine.failures.preemption import estimated_save_s
from engine.launch.deepspeed_plugin import deepspeed_plugin_problems, deepspeed_plugin_settings
from engine.launch.detect import launch_problems
from engine.launch.hardware import detect_hardware
from engine.launch.ops import prepare_ops
from engine.parallel.layout import parallel_layout
from engine.parallel.process_group import env_world_size
from engine.preflight import RunError, check_classes, check_lora_targets, check_nvme, load_data, settle_vocabulary
from engine.run_description import RunDescription
from models import get_family
from models.module_state import count_parameters


def describe_run(config_path: str, overrides: list[str]) -> RunDescription:
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
