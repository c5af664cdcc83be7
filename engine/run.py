"""One training run from a config file, in the order that keeps failures cheap: validate the
config, read the data, and only then start the process group and build the model."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data import DataBundle, build_datasets, make_eval_loader, make_train_loader
from engine.backends import AccelerateBackend, Backend, PipelineBackend, build_backend
from engine.checkpoint import checkpoint_root, resume_target, step_tag
from engine.config import ConfigError, ConfigIssue, EngineConfig, load_config
from engine.distributed import (
    barrier,
    destroy_process_group,
    env_world_size,
    init_process_group,
    is_main_process,
)
from engine.export import export_model, sample_text
from engine.hardware import Hardware, detect_hardware
from engine.launcher import launch_problems
from engine.metrics import MetricsLogger
from engine.parallel.layout import parallel_layout
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
        return build_datasets(
            config.data,
            family=config.model["family"],
            seed=config.trainer["seed"],
            seq_len=config.data["seq_len"],
            vocab_size=None if config.model.get("vocab_size", "auto") == "auto" else config.model["vocab_size"],
            num_classes=config.model.get("num_classes"),
        )
    except (ValueError, FileNotFoundError) as error:
        raise RunError(f"data error: {error}") from None


def settle_vocabulary(config: EngineConfig, bundle: DataBundle) -> EngineConfig:
    """Give the model the tokenizer's vocabulary, or refuse a vocabulary that cannot hold it."""
    if bundle.vocab_size is None:
        return config
    config = config.with_vocab_size(bundle.vocab_size)
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


@dataclass(frozen=True)
class Prepared:
    """What `prepare` established before any process group: the run may now start."""

    config: EngineConfig
    data: DataBundle
    hardware: Hardware
    resume: tuple[Path, str] | None


def prepare(config_path: str, overrides: list[str]) -> Prepared:
    """Everything that can fail because of user input, done before any process group exists."""
    hardware = detect_hardware()
    config = load_config(config_path, overrides, world_size=env_world_size(), hardware=hardware)
    problems = launch_problems(config.trainer["backend"], config.precision, config.world_size)
    if problems:
        raise RunError("launch error:\n  " + "\n  ".join(problems))
    torch.set_num_threads(config.trainer["threads_per_rank"])
    bundle = load_data(config)
    config = settle_vocabulary(config, bundle)
    try:
        resume = resume_target(config.trainer["resume"], Path(config.trainer["output_dir"]))
    except FileNotFoundError as error:
        raise RunError(str(error)) from None
    return Prepared(config, bundle, hardware, resume)


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
    )


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


def run(config_path: str, overrides: list[str]) -> int:
    try:
        prepared = prepare(config_path, overrides)
    except (ConfigError, RunError) as error:
        if is_main_process():
            print(error, file=sys.stderr)
        return 2

    config, bundle = prepared.config, prepared.data
    trainer = config.trainer
    output_dir = Path(trainer["output_dir"])
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "resolved_config.json").write_text(json.dumps(config.document, indent=2) + "\n")

    device = init_process_group(prepared.hardware.device_type)
    family = get_family(config.model["family"])
    seed_everything(trainer["seed"])
    backend, dp_rank = build_backend(config, family, device, _DTYPES[config.precision])
    start_step = 0 if prepared.resume is None else int(backend.load(*prepared.resume)["step"])

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
    )

    def eval_batches():
        return make_eval_loader(
            bundle.validation,
            micro_batch_size=micro_batch,
            dp_rank=dp_rank,
            dp_size=config.dp_size,
            max_batches=trainer["eval_batches"],
            num_workers=config.data["num_workers"],
        )

    settings = loop_settings(config)
    logger = MetricsLogger(
        output_dir,
        enabled=is_main_process(),
        total_steps=settings.max_steps,
        start_step=start_step,
        progress_bar=trainer["progress_bar"],
    )
    if isinstance(backend, AccelerateBackend):
        logger.write(backend.describe())
    layout = parallel_layout(config)
    if layout.model_parallel:
        logger.write(layout.describe(backend.stage_layers() if isinstance(backend, PipelineBackend) else None))
    logger.write(
        f"training {config.model['family']} {config.model['preset']} on {config.world_size} rank(s), "
        f"{config.trainer['backend']} backend, ZeRO stage {config.zero_stage}, {config.precision}, "
        f"global batch {config.document['train_batch_size']}"
        + (f", resuming at step {start_step}" if start_step else "")
    )

    def save(step: int) -> None:
        backend.save(checkpoint_root(output_dir), step_tag(step), {"step": step})

    last_saved = train(backend, family, batches, eval_batches, settings, logger, save, start_step)
    if trainer["export"]:
        export_and_sample(config, family, backend, bundle, step_tag(last_saved), logger)
    logger.close()
    destroy_process_group()
    return 0
