"""One training run from a config file, in the order that keeps failures cheap: everything the
inputs can get wrong first (engine/prepare.py), and only then the process group, the model, the
loop, the export; a failure after that ends the job through engine/failures/ending.py."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data import DataBundle, make_eval_loader, make_train_loader
from data.streaming import StreamedCorpus, stream_micro_batches
from engine.backends import Backend, PipelineBackend, build_backend
from engine.checkpoints.from_torch import universal_from_torch, universal_from_zero0
from engine.checkpoints.layout import describe
from engine.checkpoints.store import (
    checkpoint_root,
    load_data_position,
    load_rank_buffers,
    load_rng_state,
    save_checkpoint,
    step_tag,
)
from engine.checkpoints.universal import UNIVERSAL_FOLDER, convert_to_universal
from engine.config import ConfigError, EngineConfig
from engine.distributed import (
    barrier,
    destroy_process_group,
    env_rank,
    env_world_size,
    init_process_group,
    is_main_process,
)
from engine.export import export_model, sample_text
from engine.failures.ending import collective_timeout, end_after_failure
from engine.failures.faults import inject, loss_hook
from engine.failures.watchdog import Watchdog
from engine.flops import gpt_flops_per_token, resnet_flops_per_image
from engine.metrics import MetricsLogger
from engine.nonfinite import NonfinitePolicy
from engine.parallel.layout import parallel_layout
from engine.plots import write_plots
from engine.prepare import Prepared, RunError, prepare
from engine.rank_logs import capture_rank_output
from engine.sinks import build_sinks
from engine.timeline import write_pipeline_timeline
from engine.train import LoopSettings, train
from models import ModelFamily, get_family

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    stream = bundle.train.windows(dp_rank, config.dp_size) if isinstance(bundle.train, StreamedCorpus) else None
    if stream is not None:
        if tag_dir is not None:
            stream.load_state_dict(load_data_position(tag_dir, env_rank()))
        batches = stream_micro_batches(stream, micro_batch)
    else:
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
        saved, now = describe(prepared.saved_layout), describe(prepared.layout)
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
            layout=prepared.layout,
            buffers=backend.local_buffers(),
            before_publish=lambda: inject(prepared.fault, env_rank(), "save", step),
            data_position=stream.state_dict() if stream is not None else None,
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
    own_checkpoint = checkpoint_root(output_dir) / step_tag(start_step)
    if last_saved == start_step and tag_dir is not None and (tag_dir != own_checkpoint or prepared.reshape):
        # Nothing left to train: the export reads this run's own checkpoint, so the loaded state is
        # saved first, in this layout and this output_dir (converting the checkpoint without training).
        save(start_step)
    if isinstance(backend, PipelineBackend):
        write_pipeline_timeline(backend, output_dir, logger.write)
    if trainer["export"]:
        export_and_sample(config, family, backend, bundle, step_tag(last_saved), logger)
    logger.close()
    if trainer["plots"] and is_main_process():
        paths = write_plots(output_dir)
        print(f"plots: {len(paths)} PNGs in {paths[0].parent if paths else output_dir}", flush=True)
