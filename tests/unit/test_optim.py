"""Which parameters weight decay reaches: the groups every backend, the planner, the test reference
and the benchmarks' baselines build their optimizers from."""

from __future__ import annotations

import pytest
import torch

from engine.backends.optim import build_optimizer, parameter_groups
from models import get_family

ADAMW = {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.5}}


def tiny(family: str) -> torch.nn.Module:
    if family == "gpt":
        return get_family("gpt").build(
            {"preset": "tiny", "n_layer": 2, "n_head": 2, "n_embd": 16, "n_positions": 8, "vocab_size": 11}
        )
    return get_family("resnet").build({"preset": "resnet18", "num_classes": 3})


@pytest.mark.parametrize("family", ["gpt", "resnet"])
def test_matrices_decay_and_biases_and_gains_do_not(family: str):
    model = tiny(family)
    decayed, exempt = parameter_groups(model.parameters(), ADAMW, "matrices")
    assert "weight_decay" not in decayed  # the optimizer's own, optimizer.params.weight_decay
    assert exempt["weight_decay"] == 0.0
    # Told apart by the kind of layer, not by the rule's dimension count.
    gains_and_biases = {
        id(parameter)
        for module in model.modules()
        for name, parameter in module.named_parameters(recurse=False)
        if name == "bias" or isinstance(module, (torch.nn.LayerNorm, torch.nn.BatchNorm2d))
    }
    assert gains_and_biases and {id(p) for p in exempt["params"]} == gains_and_biases
    assert {id(p) for p in decayed["params"]} == {id(p) for p in model.parameters()} - gains_and_biases
    if family == "gpt":
        embeddings = {id(model.transformer.wte.weight), id(model.transformer.wpe.weight)}
        assert embeddings <= {id(p) for p in decayed["params"]}
    # Each group in the order the model registers its parameters: the order ZeRO flattens, which
    # the planner restates.
    order = [id(p) for p in model.parameters()]
    for group in (decayed, exempt):
        positions = [order.index(id(p)) for p in group["params"]]
        assert positions == sorted(positions)


@pytest.mark.parametrize(
    "section, scope",
    [
        (ADAMW, "all"),
        ({"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}}, "matrices"),
        ({"type": "AdamW", "params": {}}, "matrices"),
    ],
    ids=["scope-all", "no-decay", "decay-unset"],
)
def test_one_group_when_nothing_is_exempt(section: dict, scope: str):
    model = tiny("gpt")
    model.transformer.wpe.weight.requires_grad_(False)
    (group,) = parameter_groups(model.parameters(), section, scope)
    assert group.keys() == {"params"}
    assert [id(p) for p in group["params"]] == [id(p) for p in model.parameters() if p.requires_grad]


def test_adamw_decays_only_the_matrices():
    """A step on zero gradients is the decay alone: each matrix shrinks by lr x weight_decay, each
    bias and gain stays where it is."""
    model = tiny("gpt")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(ADAMW, parameter_groups(model.parameters(), ADAMW, "matrices"))
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    shrink = 1 - ADAMW["params"]["lr"] * ADAMW["params"]["weight_decay"]
    for name, parameter in model.named_parameters():
        expected = before[name] * shrink if parameter.ndim >= 2 else before[name]
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-6, atol=0, msg=name)
