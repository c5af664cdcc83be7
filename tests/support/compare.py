"""Comparing a launched run with the single-process reference."""

from __future__ import annotations

import torch

LOSS_TOLERANCE = 1e-5


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
