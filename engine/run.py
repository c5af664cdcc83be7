"""One training run from a config file, in the order that keeps failures cheap: validate the
config, read the data, and only then start the process group and build the model."""

from __future__ import annotations

import json
import os
import random
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from data import DataBundle, batches_per_epoch, build_datasets, make_eval_loader, make_train_loader
from engine.backends import Backend, PipelineBackend, build_backend
from engine.checkpoint import (
    checkpoint_root,
    load_rank_buffers,
    load_rng_state,
    resume_target,
    save_checkpoint,
    step_tag,
)
from engine.config import ConfigError, ConfigIssue, EngineConfig, load_config
from engine.distributed import (
    barrier,
    destroy_process_group,
    env_rank,
    env_world_size,
    init_process_group,
    is_main_process,
)
from engine.export import export_model, sample_text
from engine.failures.faults import Fault, fault_from_env, inject, loss_hook
from engine.failures.watchdog import Watchdog, beat_interval
from engine.flops import gpt_flops_per_token, resnet_flops_per_image
from engine.hardware import Hardware, detect_hardware
from engine.launch.detect import launch_problems
from engine.metrics import MetricsLogger
from engine.nonfinite import NonfinitePolicy
from engine.optim import exempts_vectors
from engine.parallel.layout import parallel_layout
from engine.parallel.torch_to_universal import universal_from_torch, universal_from_zero0
from engine.parallel.universal import UNIVERSAL_FOLDER, convert_to_universal
from engine.plots import write_plots
from engine.rank_logs import RankOutput, capture_rank_output
from engine.reshape import describe, layout_record, needs_conversion, read_layout
from engine.sinks import build_sinks
from engine.timeline import write_pipeline_timeline
from engine.train import LoopSettings, train
from models import ModelFamily, get_family

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RunError(Exception):
    """A problem with the inputs of a run (not a bug): printed as one message, exit code 2."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def load_data(config: EngineConfig) -> DataBundle:
    try:
        bundle = build_datasets(
            config.data,
            family=config.model["family"],
            seed=config.trainer["seed"],
            seq_len=config.data["seq_len"],
            vocab_size=None if config.model.get("vocab_size", "auto") == "auto" else config.model["vocab_size"],
            num_classes=config.model.get("num_classes"),
        )
        # The sampler's own check, here rather than in the first step, after every process group.
        batches_per_epoch(len(bundle.train), config.document["train_batch_size"])
    except (ValueError, FileNotFoundError) as error:
        raise RunError(f"data error: {error}") from None
    return bundle


def settle_vocabulary(config: EngineConfig, bundle: DataBundle, saved_vocab_size: int | None = None) -> EngineConfig:
    """Give the model the tokenizer's vocabulary, or refuse a vocabulary that cannot hold it.

    A resumed run keeps the vocabulary of the checkpoint (`saved_vocab_size`), which "auto" may
    have padded for another tensor-parallel degree."""
    if bundle.vocab_size is None:
        return config
    config = config.with_vocab_size(max(bundle.vocab_size, saved_vocab_size or 0))
    if config.model["vocab_size"] < bundle.vocab_size:
        raise ConfigError(
            [
                ConfigIssue(
                    "model.vocab_size",
                    f"{config.model['vocab_size']} is smaller than the tokenizer's {bundle.vocab_size} tokens "
                    f'(data.tokenizer "{config.data["tokenizer"]}"); raise it or use "auto"',
                )
            ],
            str(config.source),
        )
    return config


def check_classes(config: EngineConfig, bundle: DataBundle) -> None:
    """Refuse a classifier with fewer outputs than the data has classes: its loss would fail in the
    first forward (on a GPU as a device-side assert), after every process group had started."""
    if bundle.num_classes is None or config.model["num_classes"] >= bundle.num_classes:
        return
    raise ConfigError(
        [
            ConfigIssue(
                "model.num_classes",
                f"{config.model['num_classes']} is fewer than the {bundle.num_classes} classes of the data "
                f'(data.type "{config.data["type"]}"); raise it to at least {bundle.num_classes}',
            )
        ],
        str(config.source),
    )


@dataclass(frozen=True)
class Prepared:
    """What `prepare` established before any process group: the run may now start."""

    config: EngineConfig
    data: DataBundle
    hardware: Hardware
    resume: tuple[Path, str] | None
    saved_layout: dict | None  # the layout that saved the checkpoint resumed from
    reshape: bool  # saved on another layout: resume through a universal checkpoint
    fault: Fault | None


def prepare(config_path: str, overrides: list[str]) -> Prepared:
    """Everything that can fail because of user input, done before any process group exists."""
    hardware = detect_hardware()
    config = load_config(config_path, overrides, world_size=env_world_size(), hardware=hardware)
    problems = launch_problems(config.trainer["backend"], config.precision, config.world_size)
    if problems:
        raise RunError("launch error:\n  " + "\n  ".join(problems))
    torch.set_num_threads(config.trainer["threads_per_rank"])
    bundle = load_data(config)
    try:
        resume = resume_target(config.trainer["resume"], Path(config.trainer["output_dir"]))
        saved = read_layout(resume[0] / resume[1]) if resume else None
        config = settle_vocabulary(config, bundle, saved["vocab_size"] if saved else None)
        check_classes(config, bundle)
        get_family(config.model["family"]).check_init_from(config.model)
        reshape = resume is not None and needs_conversion(saved, checkpoint_layout(config), resume[0] / resume[1])
        fault = fault_from_env()
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise RunError(str(error)) from None
    return Prepared(config, bundle, hardware, resume, saved, reshape, fault)


def checkpoint_layout(config: EngineConfig) -> dict:
    layout = parallel_layout(config)
    vocab_size = config.model.get("vocab_size") if config.model["family"] == "gpt" else None
    groups = 2 if exempts_vectors(config.document["optimizer"], config.trainer["weight_decay_on"]) else 1
    return layout_record(
        config.trainer["backend"], layout.data, layout.pipeline, layout.tensor, config.zero_stage, vocab_size, groups
    )


def loop_settings(config: EngineConfig) -> LoopSettings:
    is_gpt = config.model["family"] == "gpt"
    trainer = config.trainer
    return LoopSettings(
        max_steps=trainer["max_steps"],
        log_interval=trainer["log_interval"],
        eval_interval=trainer["eval_interval"],
        save_interval=trainer["save_interval"],
        items_per_step=config.document["train_batch_size"] * (config.data["seq_len"] if is_gpt else 1),
        throughput_key="tokens_per_s" if is_gpt else "images_per_s",
        world_size=config.world_size,
        nonfinite=NonfinitePolicy(
            trainer["nonfinite"], trainer["max_skipped_steps"], checkpoint_root(Path(trainer["output_dir"]))
        ),
        flops_per_item=model_flops_per_item(config),
        peak_flops=None if trainer["peak_tflops"] is None else trainer["peak_tflops"] * 1e12,
    )


def model_flops_per_item(config: EngineConfig) -> int:
    """Training FLOPs per token (GPT, at the trained sequence length) or per image (ResNet)."""
    arch = get_family(config.model["family"]).architecture(config.model)
    if config.model["family"] == "gpt":
        return gpt_flops_per_token(arch["n_layer"], arch["n_embd"], arch["vocab_size"], config.data["seq_len"])
    return resnet_flops_per_image(arch, config.data["image_size"])


def export_and_sample(
    config: EngineConfig, family: ModelFamily, backend: Backend, bundle: DataBundle, tag: str, logger: MetricsLogger
) -> None:
    """Rank 0 consolidates checkpoint `tag` into the export; the others wait for it."""
    output_dir = Path(config.trainer["output_dir"])
    barrier()
    state = backend.consolidated_state_dict(checkpoint_root(output_dir), tag)
    if is_main_process():
        export_dir = output_dir / "export"
        export_model(family, state, config.model, export_dir, bundle.tokenizer)
        logger.write(f"exported consolidated fp32 weights to {export_dir}")
        tokens = config.trainer["sample_tokens"]
        if tokens and bundle.tokenizer is not None:
            text = sample_text(family, export_dir, bundle.tokenizer, tokens, config.trainer["seed"])
            logger.write("sample:\n" + text)
    barrier()


def run(config_path: str, overrides: list[str], between_steps: Callable[[int], None] | None = None) -> int:
    """One rank's whole run; the exit code. `between_steps(step)` is called after every optimizer
    step once its health is checked: the benchmarks run their baseline's step there, in the same
    process and interleaved with the engine's (bench/paired.py)."""
    try:
        prepared = prepare(config_path, overrides)
    except (ConfigError, RunError) as error:
        # Every rank prints: the launcher ends the others as soon as the first one exits, so a
        # message left to rank 0 alone is lost whenever another rank gets there first.
        print(error, file=sys.stderr)
        return 2

    trainer = prepared.config.trainer
    output = capture_rank_output(Path(trainer["output_dir"]) / "logs", env_rank())
    device = init_process_group(prepared.hardware.device_type, timeout_s=collective_timeout(trainer["comm_timeout_s"]))
    watchdog = None
    if env_world_size() > 1:
        watchdog = Watchdog(env_rank(), env_world_size(), trainer["comm_timeout_s"], output.announce).start()
    try:
        train_run(prepared, device, between_steps)
        # Rank 0 is still drawing plots: the watchdog keeps watching until every rank is here.
        barrier()
    except Exception as error:
        end_after_failure(error, watchdog, output)
    if watchdog is not None:
        watchdog.stop()
    barrier()  # rank 0 hosts the store: it leaves only once every watchdog has written `done` there
    destroy_process_group()
    return 0


def collective_timeout(silence_s: float) -> float:
    """Collectives wait a little longer than the watchdog, so a silent peer is named by the
    watchdog before a bare timeout error blames the rank that was waiting for it."""
    return silence_s + 3 * beat_interval(silence_s)


def end_after_failure(error: Exception, watchdog: Watchdog | None, output: RankOutput) -> NoReturn:
    """Log the traceback, tell every rank which rank failed first, and end this process.

    `os._exit`, not an exception: interpreter shutdown would wait on the process group and on
    DeepSpeed's threads, which is how a failed job turns into a hung one."""
    traceback.print_exc()
    summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
    own = f"rank {env_rank()} failed: {type(error).__name__}: {summary}"
    if watchdog is not None:
        if _is_communication_error(error):
            reason = watchdog.reported_failure(wait_s=watchdog.silence_s + 2 * watchdog.interval)
            if reason is not None:
                watchdog.end(reason)
        first = watchdog.report(own)
        if first != own:
            watchdog.end(first)
    output.announce(f"{own} (full log: {output.path})")
    os._exit(1)


def _is_communication_error(error: Exception) -> bool:
    """Errors a collective raises when a peer is gone: the peer, not this rank, is the culprit."""
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", "Connection", "timed out"))
    )


def reshape_checkpoint(tag_dir: Path, saved: dict[str, Any], train_batch_size: int) -> None:
    """Rank 0 converts checkpoint `tag_dir` (saved on layout `saved`) to a universal one (once: it is
    kept); the others wait."""
    if is_main_process() and not (tag_dir / UNIVERSAL_FOLDER).is_dir():
        print(f"converting {tag_dir} to a DeepSpeed universal checkpoint for this layout", flush=True)
        if saved["backend"] == "accelerate":
            universal_from_torch(tag_dir, train_batch_size)
        elif saved["zero_stage"] == 0:
            universal_from_zero0(tag_dir)
        else:
            convert_to_universal(tag_dir)
    barrier()


def train_run(prepared: Prepared, device: torch.device, between_steps: Callable[[int], None] | None = None) -> None:
    """Build the backend, train, save and export; the process group is already up."""
    config, bundle = prepared.config, prepared.data
    trainer = config.trainer
    output_dir = Path(trainer["output_dir"])
    if is_main_process():
        (output_dir / "resolved_config.json").write_text(json.dumps(config.document, indent=2) + "\n")

    family = get_family(config.model["family"])
    seed_everything(trainer["seed"])
    tag_dir = prepared.resume[0] / prepared.resume[1] if prepared.resume is not None else None
    if prepared.reshape:
        reshape_checkpoint(tag_dir, prepared.saved_layout, config.document["train_batch_size"])
    backend, dp_rank = build_backend(config, family, device, _DTYPES[config.precision], prepared.reshape)
    start_step = 0
    if tag_dir is not None:
        saved = backend.load_universal(tag_dir) if prepared.reshape else backend.load(tag_dir.parent, tag_dir.name)
        start_step = int(saved["step"])
        # Generators and each rank's buffers continue where they were only on the layout that saved them.
        if saved.get("world_size") == config.world_size:
            load_rng_state(tag_dir, env_rank())
            load_rank_buffers(tag_dir, env_rank(), backend.local_buffers())

    micro_batch = config.document["train_micro_batch_size_per_gpu"]
    batches = make_train_loader(
        bundle.train,
        micro_batch_size=micro_batch,
        grad_accum=config.document["gradient_accumulation_steps"],
        dp_rank=dp_rank,
        dp_size=config.dp_size,
        seed=trainer["seed"],
        start_step=start_step,
        num_workers=config.data["num_workers"],
        pin_memory=config.data["pin_memory"],
    )

    def eval_batches():
        return make_eval_loader(
            bundle.validation,
            micro_batch_size=micro_batch,
            dp_rank=dp_rank,
            dp_size=config.dp_size,
            max_batches=trainer["eval_batches"],
            num_workers=config.data["num_workers"],
            pin_memory=config.data["pin_memory"],
        )

    settings = loop_settings(config)
    logger = MetricsLogger(
        output_dir,
        enabled=is_main_process(),
        total_steps=settings.max_steps,
        start_step=start_step,
        progress_bar=trainer["progress_bar"],
        sinks=build_sinks(config.deepspeed_config(), backend),
    )
    description = backend.describe()
    if description is not None:
        logger.write(description)
    layout = parallel_layout(config)
    if layout.model_parallel:
        logger.write(layout.describe(backend.stage_layers() if isinstance(backend, PipelineBackend) else None))
    logger.write(
        f"training {config.model['family']} {config.model['preset']} on {config.world_size} rank(s), "
        f"{config.trainer['backend']} backend, ZeRO stage {config.zero_stage}, {config.precision_label}, "
        f"global batch {config.document['train_batch_size']}"
        + (", compiled (torch.compile)" if backend.compiled else "")
        + (f", resuming at step {start_step}" if start_step else "")
    )
    if prepared.saved_layout is not None:
        saved, now = describe(prepared.saved_layout), describe(checkpoint_layout(config))
        if prepared.reshape:
            logger.write(f"resumed through a universal checkpoint: saved on {saved}, now {now}")
        elif saved != now:
            logger.write(f"resumed on another layout: saved on {saved}, now {now}")

    def save(step: int) -> None:
        save_checkpoint(
            lambda root, tag: backend.save(root, tag, {"step": step, "world_size": config.world_size}),
            checkpoint_root(output_dir),
            step,
            keep_last=trainer["keep_checkpoints"],
            layout=checkpoint_layout(config),
            buffers=backend.local_buffers(),
            before_publish=lambda: inject(prepared.fault, env_rank(), "save", step),
        )

    def after_step(step: int) -> None:
        inject(prepared.fault, env_rank(), "step", step)
        if between_steps is not None:
            between_steps(step)

    def before_step(step: int) -> None:
        backend.loss_hook = loss_hook(prepared.fault, env_rank(), step)

    last_saved = train(
        backend, family, batches, eval_batches, settings, logger, save, start_step, after_step, before_step
    )
    if isinstance(backend, PipelineBackend):
        write_pipeline_timeline(backend, output_dir, logger.write)
    if trainer["export"]:
        export_and_sample(config, family, backend, bundle, step_tag(last_saved), logger)
    logger.close()
    if trainer["plots"] and is_main_process():
        paths = write_plots(output_dir)
        print(f"plots: {len(paths)} PNGs in {paths[0].parent if paths else output_dir}", flush=True)
