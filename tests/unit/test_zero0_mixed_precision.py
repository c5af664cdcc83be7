"""DeepSpeed's ZeRO-0 mixed-precision optimizers, built by DeepSpeed's own classes on the CPU: the export
reads their fp32 masters in both layouts they save, and fp16 gets the loss scale that
`DeepSpeedEngine.backward` leaves out (the launched GPU tests train it)."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from torch import nn

from engine.backends import fp16_loss_scale
from engine.parallel.consolidate import fp16_optimizer_masters, saved_fp16_optimizer_masters
from tests.support.process_group import world_of_one  # noqa: F401 (a fixture: pytest finds it by name)


def wrapped(wrapper: type, dtype: torch.dtype) -> tuple[FP16_Optimizer | FP16_UnfusedOptimizer, list[list]]:
    """A two-group model (matrices, then vectors, as the engine groups them) under `wrapper`, its fp32
    masters moved off the low-precision weights so that reading the weights instead would show."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).to(dtype)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = wrapper(torch.optim.AdamW(groups), low_precision_dtype=dtype, static_loss_scale=1024.0)
    for master in fp16_optimizer_masters(optimizer).values():
        master.data.add_(1e-4)
    return optimizer, [matrices, vectors]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("wrapper", [FP16_Optimizer, FP16_UnfusedOptimizer], ids=["flat", "per-parameter"])
def test_the_export_reads_the_saved_masters_of_both_optimizers(wrapper: type, tmp_path):
    """FP16_Optimizer (DeepSpeed's FusedAdam, or bf16 at ZeRO-0) saves one flat master per group;
    FP16_UnfusedOptimizer one per parameter. The first GPU run's fp16 export died on the flat one."""
    optimizer, groups = wrapped(wrapper, torch.float16)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=False)
    shapes = [[torch.empty(p.shape) for p in group] for group in groups]
    masters = saved_fp16_optimizer_masters(saved, shapes)
    live = fp16_optimizer_masters(optimizer)
    expected = [live[id(p)] for group in groups for p in group]
    assert [m.shape for m in masters] == [p.shape for group in groups for p in group]
    assert all(torch.equal(got.float(), want.float()) for got, want in zip(masters, expected, strict=True))
    assert all(not torch.equal(m.half().float(), m) for m in masters)  # masters, not the fp16 weights


@pytest.mark.usefixtures("world_of_one")
def test_fp16_without_zero_gets_the_loss_scale_engine_backward_leaves_out():
    fp16, _ = wrapped(FP16_UnfusedOptimizer, torch.float16)
    bf16, _ = wrapped(FP16_Optimizer, torch.bfloat16)
    assert fp16_loss_scale.needs_scaling(fp16)
    assert not fp16_loss_scale.needs_scaling(bf16)  # bf16 scales nothing
    assert not fp16_loss_scale.needs_scaling(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))
    loss = torch.tensor(0.5, dtype=torch.float16)
    scaled = fp16_loss_scale.scaled(fp16, loss)
    assert scaled.dtype == torch.float32 and float(scaled) == 512.0
    fp16_loss_scale.check_internals()  # DeepSpeed still scales ZeRO optimizers alone
