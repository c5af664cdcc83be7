"""Each family's `parallelize` step (models/parallelize.py) is the one place a run's model gets its
parallel form: the backend factory hands it the run's request and returns what it wrapped, and that
holds the model checkpointed and compiled as the config asks, in the backend's own wrapper."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from engine.backends.base import StepHooks
from engine.backends.factory import build_backend
from engine.describe import describe_run
from engine.trainer import backend_settings
from models import get_family
from models.activation_checkpointing import Checkpointing
from models.parallelize import Compile, ParallelRequest
from models.resnet import residual_blocks
from models.seeding import seed_everything
from tests.support.launch import ROOT
from tests.support.process_group import world_of_one  # noqa: F401 (a fixture: pytest finds it by name)

RUNS = {
    "gpt_deepspeed_attention": ("tiny_gpt.json", "deepspeed", "attention"),
    "resnet_accelerate_every_2": ("tiny_resnet.json", "accelerate", {"every": 2}),
}


def checkpointed(model: torch.nn.Module, family: str) -> list[bool]:
    """Which modules recompute in backward: a decoder's attention modules, a ResNet's residual
    blocks (their `forward` replaced on the instance, models/activation_checkpointing.py)."""
    modules = residual_blocks(model) if family == "resnet" else [block.attn for block in model.transformer.h]
    return ["forward" in vars(module) for module in modules]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("config, backend_name, checkpointing", RUNS.values(), ids=RUNS.keys())
def test_the_factory_gives_the_model_its_form_through_the_familys_parallelize_step(
    config: str, backend_name: str, checkpointing: object, tmp_path: Path
):
    overrides = [
        f"trainer.output_dir={tmp_path}",
        f"trainer.backend={backend_name}",
        "trainer.compile=true",
        f"model.activation_checkpointing={json.dumps(checkpointing)}",
    ]
    description = describe_run(str(ROOT / "configs" / config), overrides)
    family = get_family(description.config.model.family)
    requests: list[ParallelRequest] = []
    returned = []

    def recorded(model: torch.nn.Module, request: ParallelRequest) -> object:
        requests.append(request)
        returned.append(family.parallelize(model, request))
        return returned[-1]

    seed_everything(description.config.trainer.seed)
    settings = backend_settings(
        description, dataclasses.replace(family, parallelize=recorded), torch.device("cpu"), StepHooks()
    )
    backend, data_rank = build_backend(settings)

    assert returned == [backend] and data_rank == 0
    (request,) = requests
    choice = Checkpointing.of(checkpointing)
    assert request.checkpointing == choice == description.config.model.activation_checkpointing
    if backend_name == "deepspeed":
        model = backend.engine.module
        assert request.compile is Compile.WRAPPED and backend.engine.is_compiled
    else:
        model = getattr(backend.model, "module", backend.model)  # DDP holds it as `module`
        assert request.compile is Compile.BLOCKS
        assert all(unit._compiled_call_impl is not None for unit in family.shard_units(model))
    assert backend.compiled
    # Exactly the modules the choice names recompute: every attention module, or every second block.
    recomputed = checkpointed(model, family.name)
    assert recomputed == [choice.attention or choice.recomputes(index) for index in range(len(recomputed))]
