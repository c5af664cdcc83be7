"""Run under the deepspeed launcher: build a backend the way a run does (from `describe_run`'s description)
and record, on each rank, what the model held as `family.build` returned it and what DeepSpeed
started from.

Writes `<out>/rank<N>.json`: the elements the rank held right after the build, the model's full
element count, whether transformers' ZeRO-3 integration was still switched on after the build, and
whether the gathered starting weights equal one process's plain `family.build` bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import deepspeed
import torch
from transformers.integrations import is_deepspeed_zero3_enabled

from engine.backends.base import StepHooks
from engine.backends.factory import build_backend
from engine.describe import describe_run
from engine.parallel.process_group import init_process_group
from engine.trainer import backend_settings
from models import get_family
from models.seeding import seed_everything


def main(config_path: str, out: Path, overrides: list[str]) -> None:
    # Its own output directory: a checkpoint another run left in the config's would be resumed.
    description = describe_run(config_path, [*overrides, f"trainer.output_dir={out}"])
    config = description.config
    family = get_family(config.model.family)
    built: dict[str, int] = {}

    def recording_build(section: dict) -> torch.nn.Module:
        model = family.build(section)
        # A partitioned parameter's own data is empty; its shard is `ds_tensor`.
        built["held"] = sum(getattr(p, "ds_tensor", p).numel() for p in model.parameters())
        built["full"] = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        return model

    device = init_process_group("cpu")
    seed_everything(config.trainer.seed)
    recording = dataclasses.replace(family, build=recording_build)
    backend, _ = build_backend(backend_settings(description, recording, device, StepHooks()))
    integration_after = is_deepspeed_zero3_enabled()
    module = backend.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        started = {name: p.detach().clone() for name, p in module.named_parameters()}
    seed_everything(config.trainer.seed)
    plain = dict(family.build(config.model.fields).named_parameters())
    record = {
        **built,
        "integration_after_build": integration_after,
        "same_as_plain_build": all(torch.equal(started[name], plain[name]) for name in started),
    }
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    arguments = [argument for argument in sys.argv[1:] if not argument.startswith("--local_rank")]
    main(arguments[0], Path(arguments[1]), arguments[2:])
