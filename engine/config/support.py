"""Valid DeepSpeed that this engine cannot honour, refused with the reason instead of ignored.

DeepSpeed accepts a key and acts on it only where the rest of the program takes part: DeepSpeed-
Chat's hybrid engine needs an RLHF loop, DeepSpeed's data efficiency its own sampler, AutoTP's
partition rules a model it can rewrite. Here such a key would be read and do nothing, so it is
refused where it is on, and the README's table lists them. DeepSpeed's spellings of what the engine
runs itself (AutoTP's size, the pipeline's stage count, Ulysses' sequence-parallel degree) are read
as the engine's keys instead (engine/config/validate.py `canonical_spellings`). Under the accelerate
backend every DeepSpeed-only key a config sets away from its default is refused, naming
`trainer.backend`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.config.errors import ConfigIssue, json_path
from engine.config.schema import AUTO, DEEPSPEED_PROPERTIES
from engine.launch.detect import effective_backend

# Top-level DeepSpeed sections the engine refuses where they are on (`enabled` true, or present for a
# section without that switch), and why.
UNSUPPORTED: dict[str, str] = {
    "hybrid_engine": "DeepSpeed-Chat's hybrid engine switches an RLHF actor between generation and training inside "
    "its own loop; this engine trains one model on a corpus",
    "data_efficiency": "curriculum learning and random-LTD need DeepSpeed's data sampler and model hooks; the engine "
    "samples its own data (data.*)",
    "tensor_parallel": "AutoTP's options rewrite the model's layers by DeepSpeed's rules; the engine splits them by "
    "the model family's own plan (models/), sized by tensor_parallel.autotp_size or parallel.tensor_parallel_size, "
    "so keep only the size",
    "expert_parallel": "no model family here has mixture-of-experts layers",
    "autotuning": "DeepSpeed's autotuner runs its own trial jobs under `deepspeed --autotuning`; `python -m engine "
    "plan` sizes layouts here",
    "weight_quantization": "post-training weight quantization is for inference; the engine trains",
    "datastates_ckpt": "DataStates-LLM needs its own package; the engine's checkpoints are written by DeepSpeed and "
    "published atomically (engine/checkpoints)",
}

# What the accelerate backend reads of the DeepSpeed keys (engine/backends/accelerate_backend.py,
# optim.py, observability/sinks.py); a key is honoured where it or a section above it is listed.
ACCELERATE_HONOURS = {
    ("train_batch_size",),
    ("train_micro_batch_size_per_gpu",),
    ("gradient_accumulation_steps",),
    ("gradient_clipping",),
    ("optimizer",),
    ("scheduler",),
    ("fp16", "enabled"),
    ("bf16", "enabled"),
    ("bf16", "check_grad_overflow"),
    ("torch_autocast",),
    ("data_types", "buffer_dtype"),
    ("zero_optimization", "stage"),
    ("zero_optimization", "offload_optimizer", "device"),
    ("zero_optimization", "offload_param", "device"),
    ("tensorboard",),
    ("csv_monitor",),
    ("wandb",),
    ("comet",),
    ("timers",),
}


def unsupported_issues(document: dict) -> Iterator[ConfigIssue]:
    """Every DeepSpeed feature in `document` the engine cannot honour on any backend."""
    for key, reason in UNSUPPORTED.items():
        value = document.get(key)
        on = value.get("enabled", True) is not False if isinstance(value, dict) else value is not None
        if key in document and on:
            yield ConfigIssue(key, f"valid DeepSpeed, but not supported by this engine: {reason}")
    yield from _nvme_issues(document)
    pipelined = document["parallel"]["pipeline_parallel_size"] > 1
    if "pipeline" in document and not pipelined:
        yield ConfigIssue(
            "pipeline",
            "DeepSpeed's pipeline options apply to pipeline stages only; set parallel.pipeline_parallel_size > 1 "
            "or drop the section",
        )
    checkpointing = document.get("activation_checkpointing", {})
    if any(value is True for value in checkpointing.values()):
        # DeepSpeed's engine never reads this section: Megatron-DeepSpeed calls
        # `deepspeed.checkpointing.configure` itself. Called for the pipeline stages, its
        # cpu_checkpointing failed inside DeepSpeed's non-reentrant checkpoint (a stage's input
        # arrived empty), so the options are refused rather than read and left without effect.
        yield ConfigIssue(
            "activation_checkpointing",
            "DeepSpeed's own activation checkpointing options take effect only where a training script calls "
            "deepspeed.checkpointing.configure (Megatron-DeepSpeed does); here pipeline stages recompute through "
            "parallel.pipeline_activation_checkpoint_interval and whole models through "
            'model.activation_checkpointing (every block, {"every": k}, "attention", {"offload": true})',
        )
    yield from _writer_issues(document.get("checkpoint", {}).get("writer"), document["trainer"]["async_save"])


def _nvme_issues(document: dict) -> Iterator[ConfigIssue]:
    """ZeRO-Infinity's NVMe offload where DeepSpeed would not honour it as written. DeepSpeed swaps to
    NVMe under ZeRO-3 only ("NVMe offloading is available only with ZeRO stage 3", its config
    reference): at stages 1 and 2 it takes `device: "nvme"` as CPU offload and says nothing
    (runtime/zero/stage_1_and_2.py reads only whether the device is not "none"), so a run sized for
    NVMe fills host memory instead. The swap folder is DeepSpeed's to name inside `nvme_path`,
    which has no default: without it the swapper fails after every process group has started."""
    zero = document["zero_optimization"]
    for section in ("offload_optimizer", "offload_param"):
        offload = zero[section]
        if offload["device"] != "nvme":
            continue
        if zero["stage"] != 3 and section == "offload_optimizer":  # offload_param's own rule covers it
            yield ConfigIssue(
                f"zero_optimization.{section}.device",
                f"DeepSpeed offloads to NVMe under ZeRO stage 3 only; at stage {zero['stage']} it would keep the "
                "optimizer states in host memory instead, saying nothing. Set zero_optimization.stage to 3 (with "
                'offload_param.device "none" the parameters stay on the device) or use "cpu"',
            )
        # swap_tensor/partitioned_optimizer_swapper.py `swap_in_optimizer_state`: one buffer for the
        # master, one per moment and one for the gradient, or the swap-in finds no buffer and fails.
        moments = 2 if document["optimizer"]["type"] in ("Adam", "AdamW") else 1
        if section == "offload_optimizer" and offload.get("buffer_count", 4) < 2 + moments:
            yield ConfigIssue(
                "zero_optimization.offload_optimizer.buffer_count",
                f"{offload['buffer_count']} is too few: DeepSpeed swaps each sub-group's master, "
                f"{moments} optimizer state(s) and gradient through one buffer each; use at least {2 + moments}",
            )
        if not offload.get("nvme_path"):
            yield ConfigIssue(
                f"zero_optimization.{section}.nvme_path",
                'required with device "nvme": a folder on a local NVMe drive, where DeepSpeed writes its swap files',
            )


def _writer_issues(writer: dict | None, async_save: bool) -> Iterator[ConfigIssue]:
    """DeepSpeed's FastPersist writer (`checkpoint.writer`) against the engine's publish: decoupled,
    it commits at the next optimizer step, after the engine would have published an unfinished
    checkpoint; and it is a checkpoint engine, where trainer.async_save installs the engine's own."""
    if not writer:
        return
    if writer.get("decoupled"):
        yield ConfigIssue(
            "checkpoint.writer.decoupled",
            "DeepSpeed's decoupled writer finishes a save at the next optimizer step, after the engine publishes it; "
            "set trainer.async_save instead, which publishes once every rank's files are whole",
        )
    elif async_save:
        yield ConfigIssue(
            "trainer.async_save",
            "checkpoint.writer selects DeepSpeed's FastPersist checkpoint engine, and trainer.async_save writes "
            "through the engine's own (engine/checkpoints/background.py); keep one",
        )


def backend_issues(given: dict, document: dict) -> Iterator[ConfigIssue]:
    """DeepSpeed-only keys that `given` (the config as written) sets away from their default while
    the accelerate backend runs it: DeepSpeed would act on them, accelerate never reads them."""
    if effective_backend(document["trainer"]["backend"]) != "accelerate":
        return
    for section in ("offload_optimizer", "offload_param"):
        if document["zero_optimization"][section]["device"] == "nvme":
            yield ConfigIssue(
                f"zero_optimization.{section}.device",
                "\"nvme\" is DeepSpeed's ZeRO-Infinity; torch's FSDP under the accelerate backend offloads to host "
                'memory only: use "cpu", or train on the DeepSpeed backend (trainer.backend "deepspeed")',
            )
    for path, value in _leaves({key: value for key, value in given.items() if key in DEEPSPEED_PROPERTIES}, ()):
        if any(path[: len(honoured)] == honoured for honoured in ACCELERATE_HONOURS):
            continue
        if value == AUTO or value == _default_at(path) or value is False or value is None:
            continue
        yield ConfigIssue(
            json_path(list(path)),
            f"{value!r} is a DeepSpeed setting the accelerate backend (trainer.backend) does not run; drop it, or "
            'train on the DeepSpeed backend (trainer.backend "deepspeed")',
        )


def _leaves(value: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path, value


def _default_at(path: tuple) -> Any:
    """The schema's default of the key at `path`, or a marker nothing equals."""
    schema: dict = {"properties": DEEPSPEED_PROPERTIES}
    for key in path:
        schema = schema.get("properties", {}).get(key)
        if schema is None:
            return object()
    return schema.get("default", object())
