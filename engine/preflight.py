"""What `validate` and `plan` check before a launch beyond the config, as a launch's `describe_run`
(engine/describe.py) checks it: the data loads and fills one global batch, the model's vocabulary and
classes hold the data's, model.lora's targets name layers of the model, and ZeRO-Infinity's folders
and buffers take what the run swaps. A failure is a `ConfigError` or `RunError`: one message, exit
code 2.

Kept apart from `describe_run`, which reads checkpoints and builds DeepSpeed's ops, so that `validate`
imports no torch: the checks that need it (LoRA's targets and NVMe's sizes, matched on a model built
on the meta device) import it for the configs that ask for them.
"""

from __future__ import annotations

import math
from pathlib import Path

from data import DataBundle, batches_per_epoch, build_datasets
from data.tokens.external import check_ids_below
from engine.config import ConfigError, ConfigIssue, EngineConfig
from engine.launch.hardware import Hardware
from engine.launch.nvme import nvme_paths, nvme_problems
from engine.parallel.layout import parallel_layout
from models import get_family
from models.lora import target_problems


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
    """What `describe_run` checks of the data, for `validate` and `plan` to check it as a launch would:
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
    from engine.checkpoints.export import base_model  # torch and the model code: LoRA configs only

    base = base_model(get_family(config.model.family), config.model.fields, weights=False)
    problems = target_problems(base, section)
    if problems:
        issues = [ConfigIssue(f"model.lora.{key}", message) for key, message in problems]
        raise ConfigError(issues, str(config.source))


def check_nvme(config: EngineConfig, hardware: Hardware) -> None:
    """ZeRO-Infinity's folders and buffers, checked on this node before its ranks start: each
    nvme_path writable, taking direct I/O and with room for the swap files `plan` counts; the swap
    buffers within what this user may page-lock; and every swapped parameter partition within
    offload_param.buffer_size, which DeepSpeed asserts only when it first swaps it in."""
    if not nvme_paths(config.document):
        return
    import torch

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
