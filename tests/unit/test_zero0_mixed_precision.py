"""DeepSpeed's ZeRO-0 mixed-precision optimizers, built by DeepSpeed's own classes on the CPU: the export
reads their fp32 masters in both layouts they save, and fp16 gets the loss scale that
`DeepSpeedEngine.backward` leaves out (the launched GPU tests train it)."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.loss_scaler import INITIAL_LOSS_SCALE, MIN_LOSS_SCALE, SCALE_WINDOW
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from torch import nn

from engine.backends.fp16_loss_scale import Fp16WithoutZero, fp16_without_zero
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
    repair = fp16_without_zero(fp16)
    assert repair is not None
    assert fp16_without_zero(bf16) is None  # bf16 scales nothing
    assert fp16_without_zero(torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)) is None
    scaled = repair.scaled(torch.tensor(0.5, dtype=torch.float16))
    assert scaled.dtype == torch.float32 and float(scaled) == 512.0


def sgd_under(wrapper: type) -> tuple[FP16_Optimizer | FP16_UnfusedOptimizer, nn.Linear]:
    """`wrapper` over plain SGD (whose update shows the gradients' size, where Adam's would not),
    with a dynamic scale from 1024 that rises after every clean step (the default: every 1000th)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).half()
    scaling = {INITIAL_LOSS_SCALE: 1024.0, SCALE_WINDOW: 1, MIN_LOSS_SCALE: 1.0}
    optimizer = wrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        low_precision_dtype=torch.float16,
        dynamic_loss_scale=True,
        dynamic_loss_args=scaling,
    )
    return optimizer, model


def three_steps(optimizer, model: nn.Linear, repair: Fp16WithoutZero | None) -> tuple[list[float], list[float]]:
    """Three clean steps on known gradients, as a backward of the scaled loss leaves them: the largest
    error of the weights against fp32 SGD on the unscaled gradients, and the norm each step reported."""
    expected = [p.detach().float().clone() for p in model.parameters()]
    errors, norms = [], []
    for _ in range(3):
        gradients = [torch.randn(p.shape) for p in model.parameters()]
        for parameter, gradient in zip(model.parameters(), gradients, strict=True):
            parameter.grad = (gradient * optimizer.loss_scale).half()
        optimizer.step()
        if repair is not None:
            repair.after_step()
        expected = [w - 0.1 * g for w, g in zip(expected, gradients, strict=True)]
        weights = [p.detach().float() for p in model.parameters()]
        errors.append(max(float((w - e).abs().max()) for w, e in zip(weights, expected, strict=True)))
        reported = float(optimizer._global_grad_norm)
        reported = repair.unscaled_norm(reported) if repair else reported
        norms.append(reported / float(torch.cat([g.flatten() for g in gradients]).norm()))
    return errors, norms


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("wrapper", [FP16_Optimizer, FP16_UnfusedOptimizer], ids=["fused", "unfused"])
def test_a_step_that_raises_the_loss_scale_applies_its_whole_update(wrapper: type):
    """DeepSpeed raises the scale before it unscales with it: such a step (every 1000th by default)
    applies half its update, and the unfused optimizer reports the norm times the scale. The repair
    defers the raise to the end of the step and divides the reported norm."""
    optimizer, model = sgd_under(wrapper)
    errors, norms = three_steps(optimizer, model, fp16_without_zero(optimizer))
    assert optimizer.loss_scale == 1024.0 * 2**2  # raised by the second and third steps
    assert max(errors) < 2e-3, errors  # fp16 weights against fp32 SGD
    assert norms == pytest.approx([1.0] * 3, rel=2e-3)

    unrepaired, model = sgd_under(wrapper)
    errors, _ = three_steps(unrepaired, model, None)
    assert errors[0] < 2e-3 and errors[1] > 0.02  # the second step, which raised the scale, lost half
