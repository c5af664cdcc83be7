"""ResNet family: torchvision's ResNet where it imports, transformers' otherwise; one architecture either way.

Both are used as their authors ship them. The two name their parameters differently, so an export
records which one wrote it. transformers is imported only to build its model (see models/gpt.py).
What checking a config needs of the family (presets, schema, checks) is models/resnet_spec.py.
"""

from __future__ import annotations

import functools
import json
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from models.activation_checkpointing import EVERY_BLOCK, Checkpointing, checkpoint_function
from models.costs import (
    FLOPS_PER_MAC,
    TRAINING_PASSES,
    ActivationEstimate,
    PlanShape,
    forward_macs,
    module_output_bytes,
)
from models.labels import IGNORE_INDEX
from models.module_state import check_state_dict
from models.parallelize import parallelize_model
from models.presets import AUTO
from models.resnet_spec import IMPLEMENTATIONS, architecture, torchvision_available

WEIGHTS_FILE = "model.safetensors"
METADATA_FILE = "export.json"

_STAGE_WIDTHS = (64, 128, 256, 512)
_EXPANSION = {"basic": 1, "bottleneck": 4}  # a bottleneck block outputs four times its width


def build(section: Mapping[str, Any]) -> nn.Module:
    """A training-mode model; the caller seeds the RNG, so every rank initialises the same weights."""
    arch = architecture(section)
    model = build_module(arch)
    init_from = section.get("init_from")
    if init_from is not None:
        _load_init_weights(model, arch, Path(init_from))
    return model


def build_module(arch: Mapping[str, Any]) -> nn.Module:
    if arch["implementation"] == "torchvision":
        return _torchvision_resnet(arch)
    if arch["implementation"] == "transformers":
        return _transformers_resnet(arch)
    raise ValueError(
        f"model.implementation {arch['implementation']!r} is unknown; choose one of: {AUTO}, "
        + ", ".join(IMPLEMENTATIONS)
    )


def _torchvision_resnet(arch: Mapping[str, Any]) -> nn.Module:
    if not torchvision_available():
        raise ValueError(
            'model.implementation is "torchvision", but torchvision does not import here; '
            'use "auto" or "transformers" (same architecture)'
        )
    # Imported here: torchvision is optional, and this is the only place that needs it.
    from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

    block = BasicBlock if arch["block"] == "basic" else Bottleneck
    return ResNet(block, list(arch["depths"]), num_classes=arch["num_classes"])


def _transformers_resnet(arch: Mapping[str, Any]) -> nn.Module:
    from transformers import ResNetForImageClassification

    return ResNetForImageClassification(_transformers_config(arch))


def _transformers_config(arch: Mapping[str, Any], class_names: Sequence[str] | None = None) -> Any:
    """transformers' defaults already match torchvision's ResNet v1.5: stride in the 3x3
    convolution, no downsampling in the first stage. Its labels are `_label_names`: transformers'
    own "LABEL_i" where the data names no classes."""
    from transformers import ResNetConfig

    expansion = _EXPANSION[arch["block"]]
    labels = _label_names(arch["num_classes"], class_names)
    return ResNetConfig(
        layer_type=arch["block"],
        depths=list(arch["depths"]),
        hidden_sizes=[width * expansion for width in _STAGE_WIDTHS],
        id2label=dict(enumerate(labels)),
        label2id={label: index for index, label in enumerate(labels)},
    )


def _label_names(num_classes: int, class_names: Sequence[str] | None) -> list[str]:
    """One name per classifier output: the data's class names, then "LABEL_i" for outputs the data
    has no class for (a classifier may be wider than the data's classes, never narrower)."""
    names = list(class_names or ())
    if len(names) > num_classes:
        raise ValueError(f"{len(names)} class names for a classifier of {num_classes} outputs")
    return names + [f"LABEL_{index}" for index in range(len(names), num_classes)]


def _from_transformers(model: nn.Module) -> bool:
    # Only a process that built transformers' ResNet has imported transformers for it.
    module = sys.modules.get("transformers")
    return module is not None and isinstance(model, module.ResNetForImageClassification)


def residual_blocks(model: nn.Module) -> list[nn.Module]:
    if _from_transformers(model):
        return [block for stage in model.resnet.encoder.stages for block in stage.layers]
    return [block for stage in (model.layer1, model.layer2, model.layer3, model.layer4) for block in stage]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as one unit each: the four residual stages."""
    if _from_transformers(model):
        return list(model.resnet.encoder.stages)
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def apply_activation_checkpointing(model: nn.Module, choice: Checkpointing = EVERY_BLOCK) -> None:
    """Recompute the residual blocks `choice` names (every one, or every k-th) in the backward pass
    instead of keeping their activations, their inputs in host memory where it offloads.

    The block's `forward` is replaced on the instance rather than the block wrapped in another
    module, so parameter names stay those of the plain model: DeepSpeed consolidates checkpoints
    by name, and exports must load into an unwrapped model.
    """
    forward = functools.partial(_checkpointed_forward, offload=choice.offload)
    for index, block in enumerate(residual_blocks(model)):
        if choice.recomputes(index):
            block.forward = types.MethodType(forward, block)


def _checkpointed_forward(block: nn.Module, hidden_state: torch.Tensor, offload: bool) -> torch.Tensor:
    return checkpoint_function(offload)(
        type(block).forward,
        block,
        hidden_state,
        context_fn=lambda: (nullcontext(), _running_stats_frozen(block)),
    )


@contextmanager
def _running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """BatchNorm updated its running statistics in the original forward; the recomputation must not
    update them again.

    Momentum 0 keeps the statistics as they are while BatchNorm still receives them, so the
    recomputation saves the same tensors for backward as the forward did (checkpoint matches them
    by position). The step counter BatchNorm increments is put back afterwards.
    """
    norms = [norm for norm in module.modules() if isinstance(norm, _BatchNorm) and norm.track_running_stats]
    saved = [(norm.momentum, norm.num_batches_tracked.clone()) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
    try:
        yield
    finally:
        for norm, (momentum, num_batches_tracked) in zip(norms, saved, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked.copy_(num_batches_tracked)


# No tensor-parallel form: the data-parallel wrappers alone spread a ResNet (models/parallelize.py).
parallelize = functools.partial(
    parallelize_model, checkpoint=apply_activation_checkpointing, tensor_parallel=None, blocks=shard_units
)


def logits_of(output: Any) -> torch.Tensor:
    """torchvision returns the logits; transformers wraps them in an output object."""
    return output if isinstance(output, torch.Tensor) else output.logits


def compute_loss(
    model: nn.Module, batch: Mapping[str, torch.Tensor], divisor: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean loss per image, or summed over the images that count and divided by `divisor`
    (engine/backends/token_mean.py: image labels are never masked in training, so no backend asks)."""
    logits = logits_of(model(batch["pixel_values"]))
    if divisor is None:
        return pipeline_loss(logits, batch["labels"])
    return F.cross_entropy(logits.float(), batch["labels"], ignore_index=IGNORE_INDEX, reduction="sum") / divisor


def eval_sums(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Summed loss, correct predictions and samples, so the means over every rank's batches are exact."""
    return pipeline_eval_sums(logits_of(model(batch["pixel_values"])), batch["labels"])


def summarize_eval(sums: Mapping[str, float]) -> dict[str, float]:
    return {"loss": sums["loss_sum"] / sums["samples"], "accuracy": sums["correct"] / sums["samples"]}


def export(
    state_dict: Mapping[str, torch.Tensor],
    section: Mapping[str, Any],
    out_dir: Path,
    class_names: Sequence[str] | None = None,
) -> None:
    """`model.safetensors`, loadable by `load_state_dict` of the recorded implementation's ResNet,
    and `export.json` naming that implementation, preset, classifier width and each output's label
    (`_label_names`), the only record of them torchvision's ResNet has; for transformers'
    implementation also its `config.json` with the same labels, so that
    `ResNetForImageClassification.from_pretrained` (or `AutoModelForImageClassification`, or an
    image-classification pipeline) loads the export as it is and names the classes it predicts."""
    arch = architecture(section)
    labels = _label_names(arch["num_classes"], class_names)
    with torch.device("meta"):
        expected = build_module(arch).state_dict()
    check_state_dict(expected, state_dict)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({key: value.detach().cpu().contiguous() for key, value in state_dict.items()}, out_dir / WEIGHTS_FILE)
    metadata = {
        "family": "resnet",
        "preset": section["preset"],
        "num_classes": arch["num_classes"],
        "implementation": arch["implementation"],
        "labels": labels,
    }
    (out_dir / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
    if arch["implementation"] == "transformers":
        _transformers_config(arch, labels).save_pretrained(out_dir)


def load_export(path: Path) -> nn.Module:
    """The exported model, in eval mode as `from_pretrained` returns transformers models."""
    model = build_module(architecture(_read_metadata(path)))
    model.load_state_dict(load_file(path / WEIGHTS_FILE))
    return model.eval()


def _read_metadata(path: Path) -> dict[str, Any]:
    metadata_path = path / METADATA_FILE
    if not metadata_path.is_file():
        raise ValueError(f"{path} is not a ResNet export: it has no {METADATA_FILE}")
    metadata = json.loads(metadata_path.read_text())
    if metadata.get("family") != "resnet":
        raise ValueError(f"{path} holds a {metadata.get('family')!r} export, not a ResNet one")
    return metadata


def check_init_from(section: Mapping[str, Any]) -> None:
    """Refuse a `model.init_from` that is no ResNet export of the configured architecture. Read
    alone, before any process group starts: the model itself is built after."""
    if section.get("init_from") is not None:
        _check_export(architecture(section), Path(section["init_from"]))


def _load_init_weights(model: nn.Module, arch: Mapping[str, Any], path: Path) -> None:
    """Start from an earlier export, refusing one whose architecture or implementation differs."""
    _check_export(arch, path)
    model.load_state_dict(load_file(path / WEIGHTS_FILE))


def _check_export(arch: Mapping[str, Any], path: Path) -> None:
    saved = architecture(_read_metadata(path))
    differences = [
        f"{field} {saved[field]!r} (configured: {arch[field]!r})" for field in arch if saved[field] != arch[field]
    ]
    if differences:
        raise ValueError(
            f"model.init_from {path} has a different architecture: {', '.join(differences)}; "
            "set the model section to match the export"
        )


# -- FLOPs and the planner's estimates ---------------------------------------------------------


def _meta_images(count: int, image_size: int) -> torch.Tensor:
    with torch.device("meta"):
        return torch.empty(count, 3, image_size, image_size)


def flops_per_image(arch: Mapping[str, Any], image_size: int) -> int:
    """Training FLOPs per image for an architecture (`architecture`'s output): the forward
    multiply-adds (`forward_macs`) of the model built and run on the meta device, where shapes
    propagate and nothing is allocated or computed; the run's own model is left alone."""
    # Evaluation mode: training-mode BatchNorm refuses a one-image batch whose last feature map is 1x1
    # (a 32-pixel CIFAR image); the multiply-adds are the same in either mode.
    with torch.device("meta"):
        model = build_module(arch).eval()
    return FLOPS_PER_MAC * TRAINING_PASSES * forward_macs(model, _meta_images(1, image_size))


def flops_per_item(arch: Mapping[str, Any], data: Mapping[str, Any]) -> int:
    return flops_per_image(arch, data["image_size"])


def plan_activations(shape: PlanShape) -> ActivationEstimate:
    """Measured on the meta model: every leaf module's output, shared evenly by the stages and its
    blocks, a quarter of a recomputed block's on the device (none where its inputs are offloaded); a
    stage sends the output of its last layer on."""
    example = _meta_images(shape.micro_batch, shape.data["image_size"])
    per_stage = module_output_bytes(shape.model, example, shape.element) // shape.stages

    def stage_bytes(stage: int, blocks: int, checkpointing: Checkpointing) -> int:
        recomputed = per_stage * checkpointing.recomputed(blocks) // blocks if blocks else 0
        return per_stage - recomputed + (0 if checkpointing.offload else recomputed // 4)

    outputs, hidden = [], example
    for layer in pipeline_layers(shape.model):
        hidden = layer(hidden)
        outputs.append(hidden.numel())
    return ActivationEstimate(stage_bytes, 0, 0, [outputs[end - 1] for end in shape.parts[1:-1]])


# -- Pipeline form ----------------------------------------------------------------------------


class _Head(nn.Module):
    """Global pooling, flattening and the classifier, as the last pipeline layer."""

    def __init__(self, pool: nn.Module, classifier: nn.Module):
        super().__init__()
        self.pool, self.classifier = pool, classifier

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(hidden), 1))


def pipeline_layers(model: nn.Module) -> list:
    """Stem, every residual block, then pooling and classifier: the model's own modules in order."""
    if _from_transformers(model):
        stem = model.resnet.embedder
        head = _Head(model.resnet.pooler, model.classifier)
    else:
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        head = _Head(model.avgpool, model.fc)
    return [stem, *residual_blocks(model), head]


def pipeline_batch(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch["pixel_values"], batch["labels"]


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Cross entropy in fp32: under bf16 the logits' rounding would show in the loss.
    return F.cross_entropy(logits.float(), labels)


def pipeline_eval_sums(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summed over the samples that count (labels other than IGNORE_INDEX)."""
    logits = logits.float()
    return {
        "loss_sum": F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum").double(),
        "correct": (logits.argmax(dim=-1) == labels).sum().double(),
        "samples": (labels != IGNORE_INDEX).sum().double(),
    }
