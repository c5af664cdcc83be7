"""What a built model holds: its parameters counted, its persistent buffers, and a state dict
checked against it."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def count_parameters(module: torch.nn.Module) -> int:
    """Unique parameters: `parameters()` yields a tied tensor once, so tied embeddings count once."""
    return sum(parameter.numel() for parameter in module.parameters())


def check_state_dict(expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> None:
    """Refuse a state dict whose names or shapes differ from the model's.

    Exporting is the last step of a run; a prefixed or truncated state dict must fail here rather
    than produce a directory that loads with freshly initialised weights.
    """
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    mismatched = sorted(
        f"{key} {tuple(given[key].shape)} != {tuple(expected[key].shape)}"
        for key in set(expected) & set(given)
        if given[key].shape != expected[key].shape
    )
    problems = [
        f"{label}: {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
        for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", mismatched))
        if keys
    ]
    if problems:
        raise ValueError("state dict does not match the configured model; " + "; ".join(problems))


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a state dict holds (a ResNet's batch-norm statistics), by name: the model's state
    that no optimizer keeps and that each rank updates on its own."""
    parameters = {id(parameter) for parameter in module.parameters()}
    return {name: tensor for name, tensor in module.state_dict(keep_vars=True).items() if id(tensor) not in parameters}
