"""model.activation_checkpointing's forms (models/activation_checkpointing.py) compute what the model without
checkpointing computes: the same loss and gradients for GPT and Llama with every block, every second
block, the attention alone, and the recomputed blocks' inputs offloaded to host memory; they recompute
what they name and no parameter is renamed. The planner orders their activations as their recompute."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.launch.hardware import detect_hardware
from engine.plan import plan_run
from engine.plan.planner import Plan
from engine.preflight import check_data
from models import get_family
from models.activation_checkpointing import SUGGESTED, Checkpointing
from models.labels import IGNORE_INDEX
from models.loss import compute_loss
from models.parallelize import ParallelRequest
from models.seeding import seed_everything

VOCAB, LENGTH = 96, 32
# Four blocks, so that every second block leaves two of them keeping their activations.
SECTIONS = {
    "llama": {
        "family": "llama",
        "preset": "tiny",
        "vocab_size": VOCAB,
        "max_position_embeddings": LENGTH,
        "num_hidden_layers": 4,
        "dropout": 0.0,
    },
    "gpt": {"family": "gpt", "preset": "tiny", "vocab_size": VOCAB, "n_layer": 4, "dropout": 0.0},
}
FORMS = {
    "every_block": True,
    "every_2": {"every": 2},
    "attention": "attention",
    "offload": {"offload": True},
    "every_2_offload": {"every": 2, "offload": True},
}


def built(family: str, checkpointing: object = False) -> torch.nn.Module:
    seed_everything(0)
    entry = get_family(family)
    return entry.parallelize(
        entry.build(SECTIONS[family]), ParallelRequest(checkpointing=Checkpointing.of(checkpointing))
    )


def token_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    labels[0, :5] = IGNORE_INDEX
    return {"input_ids": torch.randint(0, VOCAB, (2, LENGTH), generator=generator), "labels": labels}


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.base_model
    return list(base.layers if hasattr(base, "layers") else base.h)


def calls(model: torch.nn.Module, module: str) -> Counter:
    """Forward calls of submodule `module` of each block, by block: the attention's first projection
    (a recomputed attention runs its own forward, past its hooks, but calls its projections) or the
    MLP. Counted as they start: torch's recomputation stops once it has what the backward needs."""
    counted = Counter()
    for index, block in enumerate(blocks(model)):
        block.get_submodule(module).register_forward_pre_hook(lambda *_, index=index: counted.update([index]))
    return counted


def projection(model: torch.nn.Module) -> str:
    return "self_attn.q_proj" if hasattr(blocks(model)[0], "self_attn") else "attn.c_attn"


@pytest.mark.parametrize("family", list(SECTIONS))
@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_gives_the_loss_and_gradients_without_checkpointing(family: str, form: str):
    plain, checkpointed = built(family), built(family, FORMS[form])
    assert plain.state_dict().keys() == checkpointed.state_dict().keys()
    attention, mlp = calls(checkpointed, projection(checkpointed)), calls(checkpointed, "mlp")
    batch = token_batch()
    expected, loss = compute_loss(plain, batch), compute_loss(checkpointed, batch)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    for (name, parameter), twin in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(twin.grad, parameter.grad, rtol=0, atol=1e-5, msg=name)

    # Each block ran once forward; what is recomputed ran once more in the backward pass.
    choice, count = Checkpointing.of(FORMS[form]), len(blocks(checkpointed))
    whole = [index for index in range(count) if choice.recomputes(index)]
    assert whole or choice.attention
    assert mlp == {index: 2 if index in whole else 1 for index in range(count)}
    attention_runs = 2 if choice.attention else 1
    assert attention == {index: 2 if index in whole else attention_runs for index in range(count)}


def test_evaluation_recomputes_nothing():
    model = built("llama", "attention").eval()
    counted = calls(model, projection(model))
    with torch.no_grad():
        compute_loss(model, token_batch())
    assert set(counted.values()) == {1}


def test_offload_packs_the_saved_inputs_into_host_memory(monkeypatch: pytest.MonkeyPatch):
    """The recomputed blocks' inputs go through torch's save_on_cpu: one packed copy per saved input."""
    import torch.autograd.graph

    packed = []
    original = torch.autograd.graph.save_on_cpu.__init__

    def counting(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        original(self, pin_memory, device_type)
        pack = self.pack_hook

        def counted(tensor: torch.Tensor):
            packed.append(tuple(tensor.shape))
            return pack(tensor)

        self.pack_hook = counted

    monkeypatch.setattr(torch.autograd.graph.save_on_cpu, "__init__", counting)
    model = built("llama", {"every": 2, "offload": True})
    compute_loss(model, token_batch()).backward()
    # One block input, a hidden state, for each recomputed block: blocks 0 and 2 of 4.
    hidden_states = [shape for shape in packed if shape == (2, LENGTH, model.config.hidden_size)]
    assert len(hidden_states) == 2


def refusal(config: str, override: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(config, [override], world_size=1, hardware=detect_hardware(local_world_size=1))
    return str(refused.value)


def test_resnet_refuses_attention_only():
    message = refusal("configs/tiny_resnet.json", "model.activation_checkpointing=attention")
    assert "model.activation_checkpointing" in message and "a ResNet has none" in message


def test_the_schema_refuses_an_unknown_form():
    assert "model.activation_checkpointing" in refusal(
        "configs/tiny_gpt.json", 'model.activation_checkpointing={"evry": 2}'
    )


# --- the planner ---------------------------------------------------------------------------------


def choices_of(overrides: list[str]) -> tuple[dict[Checkpointing, tuple[int, int]], Plan]:
    """Four blocks: every second one leaves two keeping their activations, the last among them."""
    hardware = detect_hardware(local_world_size=1)
    overrides = ["data.path=null", "model.n_layer=4", *overrides]
    config = load_config("configs/tiny_gpt.json", overrides, world_size=1, hardware=hardware)
    plan = plan_run(check_data(config)[0])
    return {choice: (device, host) for choice, device, host in plan.choices}, plan


def test_the_planner_orders_the_choices_by_what_they_keep():
    choices, _ = choices_of([])
    assert list(choices) == list(SUGGESTED)
    none, attention, every_2, every_block, offload = (choices[choice] for choice in SUGGESTED)
    # Device memory: attention-only keeps less than nothing recomputed, more than every block; every
    # second block lies between none and every block; offloading moves the kept inputs to the host.
    assert none[0] > attention[0] > every_block[0]
    assert none[0] > every_2[0] > every_block[0]
    assert offload[0] < every_block[0] and offload[0] + offload[1] == every_block[0]
    assert none[1] == attention[1] == every_2[1] == every_block[1] == 0 < offload[1]


def test_the_plan_counts_the_configured_choice_and_its_host_memory():
    choices, plan = choices_of(['model.activation_checkpointing={"offload": true}'])
    device, host = choices[Checkpointing(every=1, offload=True)]
    assert max(rank.activations for rank in plan.ranks) == device
    assert max(rank.activations_offloaded for rank in plan.ranks) == host > 0
