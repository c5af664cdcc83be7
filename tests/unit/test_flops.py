"""Model FLOP counts against published figures, and the device peak lookup; in-process, on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.launch.hardware import device_peak_flops
from engine.observability.flops import achieved_flops_per_device, mfu
from models import get_family
from models.costs import forward_macs
from models.gpt import flops_per_token as gpt_flops_per_token
from models.module_state import count_parameters
from models.resnet import flops_per_image as resnet_flops_per_image

GPT2_124M_PARAMETERS = 124_439_808  # GPT-2 small as OpenAI released it, position table included
RESNET50_PARAMETERS = 25_557_032  # torchvision's resnet50
RESNET50_FORWARD_MACS = 4.09e9  # fvcore / ptflops at 224x224 for ResNet v1.5


@pytest.mark.parametrize("seq_len", [1024, 256])
def test_gpt2_124m_flops_per_token_is_six_n_plus_attention(seq_len: int) -> None:
    """PaLM appendix B / nanoGPT's estimate_mfu: 6N + 12*L*H*Q*T, N without the position table."""
    with torch.device("meta"):
        model = get_family("gpt").build({"preset": "124M"})
    config = model.config
    assert count_parameters(model) == GPT2_124M_PARAMETERS
    n_params = GPT2_124M_PARAMETERS - config.n_positions * config.n_embd
    head_dim = config.n_embd // config.n_head
    expected = 6 * n_params + 12 * config.n_layer * config.n_head * head_dim * seq_len

    actual = gpt_flops_per_token(config.n_layer, config.n_embd, config.vocab_size, seq_len)

    assert actual == expected


def test_resnet50_forward_macs_match_published_count() -> None:
    arch = get_family("resnet").architecture({"preset": "resnet50"})
    with torch.device("meta"):
        assert count_parameters(get_family("resnet").build({"preset": "resnet50"})) == RESNET50_PARAMETERS

    flops = resnet_flops_per_image(arch, 224)

    assert flops % 6 == 0  # 2 FLOPs per multiply-add, 3 passes
    assert flops / 6 == pytest.approx(RESNET50_FORWARD_MACS, rel=0.02)


def test_forward_macs_follow_stride_groups_and_linear_shapes() -> None:
    model = nn.Sequential(
        nn.Conv2d(4, 8, kernel_size=3, stride=2, padding=1),  # 8x8 -> 4x4
        nn.Conv2d(8, 8, kernel_size=3, padding=1, groups=4),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )
    expected = 8 * 4 * 4 * (4 * 3 * 3) + 8 * 4 * 4 * (2 * 3 * 3) + 10 * 128

    assert forward_macs(model, torch.zeros(3, 4, 8, 8)) == expected


@pytest.mark.parametrize(
    ("device_name", "precision", "tflops"),
    [
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100-PCIE-40GB", "tf32", 156),
        ("NVIDIA A10", "bf16", 125),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA L40S", "fp32", 91.6),
        ("Tesla V100-SXM2-32GB", "fp16", 125),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_device_peak_matches_cuda_device_names(device_name: str, precision: str, tflops: float) -> None:
    assert device_peak_flops(device_name, precision) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(
    ("device_name", "precision"),
    [
        ("cpu", "fp32"),
        ("CPU", "bf16"),
        ("NVIDIA Imaginary X1", "bf16"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", "bf16"),
        ("Tesla V100-SXM2-16GB", "bf16"),
    ],
)
def test_device_peak_is_none_where_no_mfu_is_claimed(device_name: str, precision: str) -> None:
    assert device_peak_flops(device_name, precision) is None


def test_device_peak_rejects_an_unknown_precision() -> None:
    with pytest.raises(ValueError, match="fp8"):
        device_peak_flops("NVIDIA H100 80GB HBM3", "fp8")


def test_mfu_divides_the_jobs_throughput_by_every_devices_peak() -> None:
    # 2 devices, 1e5 tokens/s at 6e9 FLOPs/token: 3e14 FLOP/s each, 30% of a 1e15 peak.
    assert achieved_flops_per_device(6e9, 1e5, world_size=2) == pytest.approx(3e14)
    assert mfu(6e9, 1e5, peak_flops=1e15, world_size=2) == pytest.approx(0.3)
