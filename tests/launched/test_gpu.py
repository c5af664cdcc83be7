"""Checks that need a CUDA device (NCCL, bf16 on a GPU); skipped where none is present."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import hostcost
from tests.support.launch import ROOT, launch, launch_accelerate


@pytest.mark.gpu
@pytest.mark.launch
def test_bf16_auto_trains_on_one_gpu_with_nccl(tmp_path: Path):
    run = launch("configs/tiny_gpt.json", {"bf16.enabled": "auto", "zero_optimization.stage": 2}, tmp_path, nproc=1)
    resolved = (tmp_path / "resolved_config.json").read_text()
    assert '"enabled": true' in resolved  # bf16 chosen on a bf16-capable GPU
    assert all(torch.isfinite(torch.tensor(run.losses)))
    exported = run.exported_state_dict()
    assert all(tensor.dtype == torch.float32 for tensor in exported.values())


@pytest.mark.gpu
@pytest.mark.launch
def test_accelerate_fsdp_bf16_trains_on_one_gpu(tmp_path: Path):
    run = launch_accelerate(
        "configs/tiny_gpt.json", {"bf16.enabled": True, "zero_optimization.stage": 3}, tmp_path, nproc=1
    )
    assert "accelerate backend: fsdp_full on 1 process(es)" in run.stdout
    assert all(torch.isfinite(torch.tensor(run.losses)))


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL refuses two ranks on one)")
@pytest.mark.parametrize(
    "parallel",
    [{"parallel.tensor_parallel_size": 2}, {"parallel.pipeline_parallel_size": 2}],
    ids=["tp2", "pp2"],
)
def test_model_parallel_bf16_trains_over_nccl(parallel: dict, tmp_path: Path):
    overrides = {**parallel, "bf16.enabled": True, "zero_optimization.stage": 1}
    run = launch("configs/tiny_gpt.json", overrides, tmp_path, nproc=2)
    assert all(torch.isfinite(torch.tensor(run.losses)))
    assert all(tensor.dtype == torch.float32 for tensor in run.exported_state_dict().values())


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 2], ids=["zero0", "zero2"])
def test_fp16_overflows_are_skipped_by_the_loss_scaler_and_reported(stage: int, tmp_path: Path):
    """A loss scale of 2**24 overflows fp16 gradients at once: the scaler halves it step by step
    (hysteresis 1), each overflow is counted and reported, and none stops the run under "stop".
    At ZeRO-0 the engine scales the loss that DeepSpeed's engine.backward leaves unscaled there."""
    overrides = {
        "fp16.enabled": True,
        "fp16.initial_scale_power": 24,
        "fp16.hysteresis": 1,
        "zero_optimization.stage": stage,
        "trainer.max_steps": 16,
    }
    run = launch("configs/tiny_gpt.json", overrides, tmp_path, nproc=1)
    assert json.loads((tmp_path / "resolved_config.json").read_text())["zero_optimization"]["stage"] == stage
    skipped = [record["skipped_steps"] for record in run.records]
    scales = [record["loss_scale"] for record in run.records]
    assert skipped[0] >= 1 and skipped == sorted(skipped)
    assert scales[0] < 2**24 and scales == sorted(scales, reverse=True)
    assert "fp16 gradient overflow, update skipped by the loss scaler" in run.stdout
    assert all(torch.isfinite(torch.tensor(run.losses)))
    assert all(torch.isfinite(tensor).all() for tensor in run.exported_state_dict().values())


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 2], ids=["zero0", "zero2"])
def test_a_quiet_step_never_reads_the_gpu(stage: int, tmp_path: Path):
    """Benchmark 8's count where it matters: on a GPU, with bf16 "auto", the side-stream prefetch and
    torch's fused AdamW (the default optimizer), a step that neither logs, evaluates nor saves reads
    nothing back."""
    out = tmp_path / "counts-{rank}.json"
    overrides = [*hostcost.COMMON, "bf16.enabled=auto", f"zero_optimization.stage={stage}"]
    overrides += ["optimizer.params.torch_adam=auto", f"trainer.output_dir={tmp_path / 'run'}"]
    command = [sys.executable, "-m", "bench.host_syncs", "--config", str(hostcost.CONFIG), "--out", str(out)]
    command += [arg for value in overrides for arg in ("--set", value)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = json.loads((tmp_path / "counts-0.json").read_text())["engine"]
    assert counts["counted_steps"] > 0 and counts["syncs_per_step"] == 0, counts


# Each precision as a user writes it, on one GPU. "bf16" takes the single-rank route (ZeRO-0 and
# torch_autocast); "bf16, ZeRO-2" keeps DeepSpeed's bf16 optimizer; fp16 keeps its stage either way.
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16.enabled": True, "zero_optimization.stage": 2},
    "bf16-zero2": {"bf16.enabled": True, "zero_optimization.stage": 2, "trainer.single_rank_fast_path": False},
    # DeepSpeed's FusedAdam, built by the pre-flight under the image's arch list: FP16_Optimizer's
    # flat masters at ZeRO-0, and fp16's loss scale that the engine applies there.
    "bf16-zero0-fused-adam": {
        "bf16.enabled": True,
        "optimizer.params.torch_adam": False,
        "trainer.single_rank_fast_path": False,
    },
    "fp16-zero0-fused-adam": {
        "fp16.enabled": True,
        "zero_optimization.stage": 0,
        "optimizer.params.torch_adam": False,
    },
    "fp16-zero0": {"fp16.enabled": True, "zero_optimization.stage": 0},
    "fp16-zero2": {"fp16.enabled": True, "zero_optimization.stage": 2},
    "torch_autocast": {"torch_autocast.enabled": True},
    "bf16-async-save": {"bf16.enabled": True, "trainer.async_save": True},
    "bf16-zero2-offload": {
        "bf16.enabled": True,
        "zero_optimization.stage": 2,
        "zero_optimization.offload_optimizer.device": "cpu",
    },
}
# Losses of the resumed steps and exported weights against the uninterrupted run: CUDA's embedding
# backward adds with atomics, so a resume is equal to rounding, not bit for bit.
RESUME_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.mark.gpu
@pytest.mark.launch
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_precision_trains_saves_resumes_and_exports_on_one_gpu(precision: str, tmp_path: Path):
    """Eight steps saved at step 4 and exported; a second run resumes the step-4 checkpoint and must
    train steps 5-8 to the same losses and export the same fp32 weights."""
    run = {
        **PRECISIONS[precision],
        "model.dropout": 0.0,
        "trainer.max_steps": 8,
        "trainer.save_interval": 4,
        "trainer.eval_interval": 4,
    }
    straight = launch("configs/tiny_gpt.json", run, tmp_path / "straight", nproc=1)
    checkpoint = tmp_path / "straight" / "checkpoints" / "step00000004"
    resumed = launch("configs/tiny_gpt.json", {**run, "trainer.resume": str(checkpoint)}, tmp_path / "resumed", nproc=1)
    assert all(torch.isfinite(torch.tensor(straight.losses)))
    assert straight.losses[-1] < straight.losses[0]
    norms = [record.get("grad_norm") for record in straight.records]
    counted = [norm for norm in norms if norm is not None and math.isfinite(norm) and norm > 0]
    assert len(counted) >= 6 and all(1e-3 < norm < 1e3 for norm in counted), norms  # unscaled exactly once
    assert [record["step"] for record in resumed.records] == [5, 6, 7, 8]
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses[4:]), **RESUME_TOLERANCE)
    exported, expected = resumed.exported_state_dict(), straight.exported_state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, expected[name], **RESUME_TOLERANCE, msg=name)


@pytest.mark.gpu
def test_liger_kernels_and_fused_loss_match_the_plain_llama_in_bf16():
    """model.kernels "liger" (RMSNorm, SwiGLU, RoPE) and model.loss "fused" (Liger's fused linear
    cross-entropy) on the tiny Llama in bf16 on CUDA: the plain model's loss and gradients, to bf16's
    rounding."""
    pytest.importorskip("liger_kernel")
    from models import get_family
    from models.loss import compute_loss
    from models.seeding import seed_everything

    section = {"family": "llama", "preset": "tiny", "vocab_size": 256, "max_position_embeddings": 128}
    models = []
    for extra in ({}, {"kernels": "liger", "loss": "fused"}):
        seed_everything(0)
        models.append(get_family("llama").build({**section, **extra}).to("cuda", torch.bfloat16))
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 128), generator=generator).cuda()
    labels = torch.randint(0, 256, (2, 128), generator=generator).cuda()
    plain, liger = (compute_loss(model, {"input_ids": ids, "labels": labels}) for model in models)
    plain.backward()
    liger.backward()
    torch.testing.assert_close(liger.float(), plain.float(), rtol=2e-2, atol=2e-2)
    for (name, reference), parameter in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(parameter.grad.float(), reference.grad.float(), rtol=5e-2, atol=5e-2, msg=name)


@pytest.mark.gpu
def test_the_pytorch_fused_loss_matches_the_full_logits_in_bf16_on_cuda():
    """The engine's own fused linear cross-entropy (models/tiling.py, what "fused" runs where Liger is
    not installed) in bf16 on CUDA, over 8 pieces with ignored targets: the full logits' loss and
    gradients, to bf16's rounding."""
    import torch.nn.functional as F

    from models.tiling import FusedLinearCrossEntropy

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
    weight = (0.05 * torch.randn(4096, 64, device="cuda", generator=generator)).bfloat16().requires_grad_()
    labels = torch.randint(0, 4096, (512,), device="cuda", generator=generator)
    labels[:40] = -100
    full = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
    full.backward()
    expected = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad, weight.grad = None, None
    fused = FusedLinearCrossEntropy.apply(hidden, weight, None, labels, 8)
    fused.backward()
    torch.testing.assert_close(fused, full, rtol=1e-3, atol=1e-2)
    for actual, reference in zip((hidden.grad, weight.grad), expected, strict=True):
        torch.testing.assert_close(actual.float(), reference.float(), rtol=5e-2, atol=5e-2)
