"""Comparing a launched run with the single-process reference."""

from __future__ import annotations

import torch

LOSS_TOLERANCE = 1e-5
# With clipping on, ZeRO-1/2 sum the global gradient norm in fp64 where torch sums it in fp32; the
# clip coefficients differ in the last bit, and Adam turns that into a visible step for the few
# elements whose gradient is near eps. Such an element can move by at most about lr per step, so
# the bound is one learning-rate step (docs/design/models.md, "The tiny ResNet of the tests").
# configs/tiny_gpt.json decays by 0.1, so a gain wrongly decayed shrinks by lr x 0.1 = 1e-4 a step and
# leaves the bound within its 5 steps: the bound still sees which parameters a backend decays.
CLIPPED_WEIGHT_TOLERANCE = 1e-4
# Without clipping every mode does the reference's arithmetic; measured: bit-identical except
# ZeRO-3's small persistent parameters (all-reduced, not reduce-scattered), one ulp (1e-10) apart.
UNCLIPPED_WEIGHT_TOLERANCE = 1e-7


def max_loss_difference(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference), (losses, reference)
    return max(abs(a - b) for a, b in zip(losses, reference, strict=True))


def assert_grad_norms_match(records: list[dict], reference: list[float], rtol: float = 1e-4) -> None:
    """Every logged step's `grad_norm` is the reference's norm of that step, before clipping."""
    for record in records:
        expected = reference[record["step"] - 1]
        assert abs(record["grad_norm"] - expected) <= rtol * expected, (record["step"], record["grad_norm"], expected)


def assert_weights_match(exported: dict[str, torch.Tensor], reference: torch.nn.Module, atol: float) -> None:
    """Every trained parameter of the reference equals the exported one. Buffers are left out:
    BatchNorm running statistics are per rank under data parallelism, as in DDP."""
    parameters = dict(reference.named_parameters())
    compared = [name for name in parameters if name in exported]
    tied = {name for name in parameters if name not in exported}
    assert tied <= {"lm_head.weight"}, f"export lacks {sorted(tied)}"
    for name in compared:
        torch.testing.assert_close(
            exported[name],
            parameters[name].detach(),
            rtol=0,
            atol=atol,
            msg=lambda detail, name=name: f"{name}: {detail}",
        )


def assert_eval_matches(records: list[dict], reference_eval_loss: float | None, tolerance: float) -> None:
    """The run's evaluation after its last step is the reference's (which decoders' runs have)."""
    assert reference_eval_loss is not None, "the reference evaluates decoders (token samples) only"
    evaluated = records[-1]["eval_loss"]
    assert abs(evaluated - reference_eval_loss) <= tolerance, (evaluated, reference_eval_loss)
