"""The ResNet family as checking a config sees it: presets, the model section's schema and checks,
the architecture (with "auto" settled to the implementation that imports here), what it trains on and
the pipeline form it has.

`python -m engine validate` reads only this module of the family; building, training, exporting and
costing a model is models/resnet.py, which the registry (models/registry.py) imports at the first call
that needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any

from models.activation_checkpointing import Checkpointing
from models.presets import AUTO, merge_preset, setting

IMPLEMENTATIONS = ("torchvision", "transformers")

# torchvision initialises its ResNet in the constructor, after its submodules exist: under
# `deepspeed.zero.Init` they would already be partitioned, so ResNets are built whole.
BUILDS_PARTITIONED = False

PRESETS: Mapping[str, Mapping[str, Any]] = {
    "resnet18": {"block": "basic", "depths": (2, 2, 2, 2)},
    "resnet34": {"block": "basic", "depths": (3, 4, 6, 3)},
    "resnet50": {"block": "bottleneck", "depths": (3, 4, 6, 3)},
    "resnet101": {"block": "bottleneck", "depths": (3, 4, 23, 3)},
    "resnet152": {"block": "bottleneck", "depths": (3, 8, 36, 3)},
}

# The model section's own keys, as JSON Schema (engine/config/schema.py adds the keys every family has).
MODEL_SCHEMA: Mapping[str, Mapping[str, Any]] = {
    "preset": {"enum": list(PRESETS), "description": "ResNet depth."},
    "num_classes": {"type": "integer", "minimum": 2, "description": "Classifier outputs.", "default": 1000},
    "implementation": {
        "enum": [AUTO, *IMPLEMENTATIONS],
        "description": '"auto": torchvision where it imports, transformers\' ResNet otherwise (same architecture).',
        "default": AUTO,
    },
}

# Trained on labelled images, counted one by one; the classes come from the model section.
DATA_TYPES = ("image", "synthetic")

SAMPLES = "images"

THROUGHPUT_KEY = "images_per_s"

USES_VOCABULARY = False

# `plan --suggest` does not try model.activation_checkpointing on a ResNet, whose checkpointed
# activations are only estimated, as a flat quarter of the whole (`plan_activations`).
SUGGESTS_CHECKPOINTING = False


@functools.cache
def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # a wheel built for another torch or CUDA fails with RuntimeError or OSError
        return False
    return True


def architecture(section: Mapping[str, Any]) -> dict[str, Any]:
    """The preset's blocks, the classifier width and the implementation, with "auto" settled here.

    Settling "auto" once means build, export and the run's logs all name the same implementation.
    """
    implementation = setting(section, "implementation", AUTO)
    if implementation == AUTO:
        implementation = "torchvision" if torchvision_available() else "transformers"
    return {
        **merge_preset("resnet", PRESETS, section),
        "num_classes": setting(section, "num_classes", 1000),
        "implementation": implementation,
    }


def hidden_size(arch: Mapping[str, Any]) -> None:
    """No single width: ZeRO keeps DeepSpeed's default bucket sizes."""
    return None


def context_length(arch: Mapping[str, Any]) -> None:
    """Images, not sequences: there is no data.seq_len to settle."""
    return None


# -- Config checks ----------------------------------------------------------------------------


def config_issues(
    section: Mapping[str, Any], data: Mapping[str, Any], micro_batch: int | None
) -> Iterator[tuple[str, str]]:
    """What the schema cannot say about a ResNet config: (JSON path, how to fix it) pairs."""
    # Five stride-2 steps: a 32-pixel image ends as a 1x1 map, one value per channel per image,
    # which training-mode BatchNorm cannot normalise.
    if micro_batch == 1 and data["image_size"] <= 32:
        yield (
            "train_micro_batch_size_per_gpu",
            f"1 image of {data['image_size']} pixels leaves ResNet's BatchNorm one value per channel in its "
            "last stage (a 1x1 map); use a micro-batch of 2 or more",
        )
    if Checkpointing.of(section.get("activation_checkpointing")).attention:
        yield (
            "model.activation_checkpointing",
            '"attention" recomputes the attention of each transformer block, and a ResNet has none; use true or '
            '{"every": k} to recompute residual blocks',
        )
    if section.get("implementation") == "torchvision" and not torchvision_available():
        yield (
            "model.implementation",
            '"torchvision", but torchvision does not import here; use "auto" or "transformers" (same architecture)',
        )


def items_per_sample(data: Mapping[str, Any]) -> int:
    """Throughput and MFU count images, one a sample."""
    return 1


PIPELINE_BLOCK_TYPE = "BasicBlock|Bottleneck|ResNetBasicLayer|ResNetBottleNeckLayer"


def pipeline_blocks(arch: Mapping[str, Any]) -> int:
    return sum(arch["depths"])


EVAL_SUMS = ("correct", "loss_sum", "samples")
