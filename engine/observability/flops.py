"""Model FLOPs per trained item and device peaks, so a run can report achieved TFLOP/s and MFU.

The counts are *model* FLOPs, the convention of PaLM's MFU (Chowdhery et al. 2022, arXiv:2204.02311,
appendix B): what one training step of the model needs mathematically, so activation
recomputation, padding and redundant work do not raise the figure. One multiply-accumulate is two
FLOPs, and training costs three forward passes: the backward pass computes a gradient with respect
to both the input and the weights of every matmul, each as costly as the forward product.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from models.resnet import build_module

FLOPS_PER_MAC = 2
TRAINING_PASSES = 3  # forward, then backward's input gradient and weight gradient


def gpt_flop_parameters(n_layer: int, n_embd: int, vocab_size: int) -> int:
    """N of the "6N" term: GPT-2's parameters without the position table, computed from its shape.

    The position table is a lookup added to the input, no matmul, so it is left out. The token
    table is counted once: tied to the LM head, it is the weight of the logits matmul, which costs
    vocab_size * n_embd multiply-adds per token. Biases and LayerNorm weights stay in, as nanoGPT's
    `get_num_params()` keeps them (0.1% of GPT-2 124M), so the figures compare with nanoGPT's.
    Computed from the shape rather than counted on the model because under ZeRO-3, tensor or
    pipeline parallelism a rank holds only a shard of the parameters.
    """
    per_layer = (
        (n_embd * 3 * n_embd + 3 * n_embd)  # query, key and value projection
        + (n_embd * n_embd + n_embd)  # attention output projection
        + (n_embd * 4 * n_embd + 4 * n_embd)  # MLP up projection
        + (4 * n_embd * n_embd + n_embd)  # MLP down projection
        + 2 * 2 * n_embd  # two LayerNorms, weight and bias
    )
    final_norm = 2 * n_embd
    return n_layer * per_layer + final_norm + vocab_size * n_embd


def gpt_flops_per_token(n_layer: int, n_embd: int, vocab_size: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N plus attention, as nanoGPT's `estimate_mfu` and PaLM appendix B.

    6N covers every weight matmul (2 FLOPs per multiply-add, 3 passes). Attention's scores and
    weighted sum are matmuls without weights: per layer and token, seq_len * n_embd multiply-adds
    each, so 12 * n_layer * n_embd * seq_len for training. The causal mask's unused half is
    counted, as PaLM and Megatron-LM (Narayanan et al. 2021, arXiv:2104.04473, whose
    72*B*s*l*h^2*(1 + s/6h + V/12lh) is the same count) do. `seq_len` is the length trained on
    (`data.seq_len`), not `n_positions`: attention costs what the sequences are.
    """
    n_params = gpt_flop_parameters(n_layer, n_embd, vocab_size)
    attention = FLOPS_PER_MAC * TRAINING_PASSES * 2 * n_layer * n_embd * seq_len
    return FLOPS_PER_MAC * TRAINING_PASSES * n_params + attention


def forward_macs(model: nn.Module, example: torch.Tensor) -> int:
    """Multiply-accumulates of every `nn.Conv2d` and `nn.Linear` in one forward pass, per sample.

    Hooks read the output shapes the real model produces, so strides, padding and either ResNet
    implementation are followed without restating the architecture here. Normalisation,
    activations, pooling and residual additions are left out (about 1% of a ResNet's work), as the
    ResNet paper's "multiply-adds" (He et al. 2016, arXiv:1512.03385, table 1) leave them out.
    """
    macs = 0

    def count(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        nonlocal macs
        outputs_per_sample = output.numel() // output.shape[0]
        if isinstance(module, nn.Conv2d):
            kernel_h, kernel_w = module.kernel_size
            macs += outputs_per_sample * (module.in_channels // module.groups) * kernel_h * kernel_w
        else:
            macs += outputs_per_sample * module.in_features

    handles = [
        module.register_forward_hook(count) for module in model.modules() if isinstance(module, nn.Conv2d | nn.Linear)
    ]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for handle in handles:
            handle.remove()
    return macs


def resnet_flops_per_image(arch: Mapping[str, Any], image_size: int) -> int:
    """Training FLOPs per image for a ResNet architecture (`models.resnet.architecture`'s output).

    The model is built on the meta device and run on a meta image: shapes propagate, nothing is
    allocated or computed, and the run's own model, possibly sharded or wrapped, is left alone.
    """
    with torch.device("meta"):
        # Evaluation mode: training-mode BatchNorm refuses a one-image batch whose last feature map
        # is 1x1 (a 32-pixel CIFAR image); the multiply-adds are the same in either mode.
        model = build_module(arch).eval()
        example = torch.empty(1, 3, image_size, image_size)
    return FLOPS_PER_MAC * TRAINING_PASSES * forward_macs(model, example)


# Dense peak FLOP/s (no 2:4 sparsity) from the vendors' datasheets: NVIDIA A100, H100, H200, L4,
# L40S, A10 and V100 datasheets; NVIDIA Ada Lovelace architecture whitepaper, appendix A (RTX
# 4090, bf16/fp16 with fp32 accumulation, which PyTorch uses); AMD Instinct MI300X datasheet.
# Where a datasheet quotes only the sparse figure, half of it is the dense one. "fp32" is the
# non-tensor-core peak: the engine leaves TF32 matmuls off, PyTorch's default.
_TERA = 1e12
PEAK_FLOPS: Mapping[str, Mapping[str, float]] = {
    "A100": {"bf16": 312 * _TERA, "fp16": 312 * _TERA, "tf32": 156 * _TERA, "fp32": 19.5 * _TERA},
    "H100 SXM": {"bf16": 989.5 * _TERA, "fp16": 989.5 * _TERA, "tf32": 494.5 * _TERA, "fp32": 67 * _TERA},
    "H100 PCIe": {"bf16": 756.5 * _TERA, "fp16": 756.5 * _TERA, "tf32": 378 * _TERA, "fp32": 51 * _TERA},
    "H100 NVL": {"bf16": 835.5 * _TERA, "fp16": 835.5 * _TERA, "tf32": 417.5 * _TERA, "fp32": 60 * _TERA},
    "H200 SXM": {"bf16": 989.5 * _TERA, "fp16": 989.5 * _TERA, "tf32": 494.5 * _TERA, "fp32": 67 * _TERA},
    "H200 NVL": {"bf16": 835.5 * _TERA, "fp16": 835.5 * _TERA, "tf32": 417.5 * _TERA, "fp32": 60 * _TERA},
    "L4": {"bf16": 121 * _TERA, "fp16": 121 * _TERA, "tf32": 60 * _TERA, "fp32": 30.3 * _TERA},
    "L40S": {"bf16": 362.05 * _TERA, "fp16": 362.05 * _TERA, "tf32": 183 * _TERA, "fp32": 91.6 * _TERA},
    "A10": {"bf16": 125 * _TERA, "fp16": 125 * _TERA, "tf32": 62.5 * _TERA, "fp32": 31.2 * _TERA},
    # Volta has fp16 tensor cores only: no bf16, no tf32.
    "V100 SXM2": {"fp16": 125 * _TERA, "fp32": 15.7 * _TERA},
    "V100 PCIe": {"fp16": 112 * _TERA, "fp32": 14 * _TERA},
    "V100S PCIe": {"fp16": 130 * _TERA, "fp32": 16.4 * _TERA},
    "RTX 4090": {"bf16": 165.2 * _TERA, "fp16": 165.2 * _TERA, "tf32": 82.6 * _TERA, "fp32": 82.6 * _TERA},
    "MI300X": {"bf16": 1307.4 * _TERA, "fp16": 1307.4 * _TERA, "tf32": 653.7 * _TERA, "fp32": 163.4 * _TERA},
}
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

# `torch.cuda.get_device_name()` patterns, first match wins: variants sharing a chip name ("H100
# NVL", "H100 PCIe") come before the bare name, which the SXM part reports ("NVIDIA H100 80GB
# HBM3", "NVIDIA H200"). Word boundaries keep "A10" from matching "A100" and "L4" from "L40S";
# the 4090 must end the name, so a laptop part or the cut-down 4090 D claims nothing.
_DEVICE_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), product)
    for pattern, product in (
        (r"\bA100\b", "A100"),
        (r"\bH100 NVL\b", "H100 NVL"),
        (r"\bH100 PCIe\b", "H100 PCIe"),
        (r"\bH100\b", "H100 SXM"),
        (r"\bH200 NVL\b", "H200 NVL"),
        (r"\bH200\b", "H200 SXM"),
        (r"\bL4\b", "L4"),
        (r"\bL40S\b", "L40S"),
        (r"\bA10\b", "A10"),
        (r"\bV100S\b", "V100S PCIe"),
        (r"\bV100-SXM2\b", "V100 SXM2"),
        (r"\bV100-PCIE\b", "V100 PCIe"),
        (r"\bRTX 4090$", "RTX 4090"),
        (r"\bMI300X\b", "MI300X"),
    )
)


def device_product(device_name: str) -> str | None:
    """The `PEAK_FLOPS` row for a device name, or None for a CPU or a device not in the table."""
    for pattern, product in _DEVICE_PATTERNS:
        if pattern.search(device_name.strip()):
            return product
    return None


def device_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of one device at `precision`, or None where the engine claims no MFU.

    None for a CPU, an unknown device, or a precision the device has no peak for (bf16 on a V100):
    a guessed peak would make the MFU a number nobody can compare.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is unknown; choose one of: {', '.join(PRECISIONS)}")
    product = device_product(device_name)
    return None if product is None else PEAK_FLOPS[product].get(precision)


def achieved_flops_per_device(flops_per_item: float, items_per_s: float, world_size: int) -> float:
    """Model FLOP/s each device delivers, from the whole job's throughput.

    `world_size` counts every device of the job, not the data-parallel degree: tensor and pipeline
    ranks share the work on the same items.
    """
    return flops_per_item * items_per_s / world_size


def mfu(flops_per_item: float, items_per_s: float, peak_flops: float, world_size: int) -> float:
    """Model FLOPs utilisation: the fraction of the job's summed device peaks its throughput uses."""
    return achieved_flops_per_device(flops_per_item, items_per_s, world_size) / peak_flops
