"""The step's loss as the global token mean (engine/backends/token_mean.py), in one process: the
divisor's arithmetic against plain transformers' loss over the same tokens, and what the decoder
families pass the model (position ids). The launched proof across ranks and accumulation is
tests/launched/test_token_mean_launched.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bench.host_syncs import HostCounter
from engine.backends.token_mean import TargetCount
from engine.config import ConfigError
from engine.config.load import check_document
from engine.launch.hardware import Hardware
from models import get_family
from models.labels import IGNORE_INDEX
from tests.support.launch import ROOT

LLAMA = get_family("llama")
VOCAB = 65


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LLAMA.build({"family": "llama", "preset": "tiny", "vocab_size": VOCAB})


def masked_batch(seed: int, rows: int, length: int, targets_from: list[int]) -> dict[str, torch.Tensor]:
    """Token ids whose labels are masked before `targets_from[row]` in each row (a prompt), as chat
    data masks what the assistant did not say."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (rows, length), generator=generator)
    labels = torch.randint(0, VOCAB, (rows, length), generator=generator)
    for row, start in enumerate(targets_from):
        labels[row, :start] = IGNORE_INDEX
    return {"input_ids": input_ids, "labels": labels}


# Four micro-batches of 2 rows holding 31, 6, 0 and 20 targets.
MICRO_BATCHES = [
    masked_batch(1, 2, 16, [0, 1]),
    masked_batch(2, 2, 16, [13, 13]),
    masked_batch(3, 2, 16, [16, 16]),
    masked_batch(4, 2, 16, [4, 8]),
]


def plain_global_mean(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """transformers' logits, cross-entropy summed over every target of every batch, over their count."""
    total = sum(
        F.cross_entropy(
            model(input_ids=batch["input_ids"]).logits.float().flatten(0, 1),
            batch["labels"].flatten(),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        for batch in batches
    )
    return total / sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def test_summed_losses_over_the_divisor_give_the_global_token_mean_and_its_gradient():
    """One rank accumulating four micro-batches of 31, 6, 0 and 20 targets, each loss divided by the
    count per micro-batch and the backward by the accumulation steps (as DeepSpeed's does), trains the
    loss and gradient of the 57 targets taken together; the mean of the micro-batches' own means,
    which weights each of the 6 targets of the second five times as much as one of the first's, does not."""
    model = tiny_llama()
    reference = plain_global_mean(model, MICRO_BATCHES)
    reference.backward()
    expected = gradients(model)

    divisor = TargetCount(accumulation=4, data_parallel=1, group=None).divisor(MICRO_BATCHES)
    assert divisor.item() == pytest.approx(57 / 4)
    logged = torch.zeros(())
    for batch in MICRO_BATCHES:
        loss = LLAMA.compute_loss(model, batch, divisor)
        (loss / 4).backward()
        logged += loss.detach()
    assert (logged / 4).item() == pytest.approx(reference.item(), rel=1e-6)
    for name, gradient in gradients(model).items():
        torch.testing.assert_close(gradient, expected[name], rtol=1e-5, atol=1e-7, msg=name)

    counted = [batch for batch in MICRO_BATCHES if (batch["labels"] != IGNORE_INDEX).any()]
    means = torch.stack([LLAMA.compute_loss(model, batch) for batch in counted]).mean()
    assert abs(means.item() - reference.item()) > 1e-3


def test_a_step_without_targets_trains_on_nothing_rather_than_nan():
    model = tiny_llama()
    empty = masked_batch(5, 2, 16, [16, 16])
    divisor = TargetCount(accumulation=1, data_parallel=1, group=None).divisor([empty])
    loss = LLAMA.compute_loss(model, empty, divisor)
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.count_nonzero(parameter.grad) == 0 for parameter in model.parameters())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_packed_conversations_train_and_evaluate_as_if_alone(name: str, attention: str):
    """A window packing two conversations, positions restarting at the second: the family's loss and
    evaluation sums, through the model as the engine builds it (under "sdpa" the engine's own
    attention, which builds no mask from the positions), equal those of each conversation alone; as
    one sequence (positions 0..T-1) the second attends to the first and they differ. The engine's
    attention masks them without reading the positions back from the device."""
    family = get_family(name)
    torch.manual_seed(0)
    model = family.build({"family": name, "preset": "tiny", "vocab_size": VOCAB, "attn_implementation": attention})
    model.eval()
    first, second = masked_batch(6, 1, 6, [2]), masked_batch(7, 1, 10, [3])
    packed = {key: torch.cat([first[key], second[key]], dim=1) for key in ("input_ids", "labels")}
    packed["position_ids"] = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with torch.no_grad(), HostCounter() as counter:
        loss = family.compute_loss(model, packed)
    assert counter.total_syncs == 0 or attention == "eager"
    with torch.no_grad():
        sums = family.eval_sums(model, packed)
        alone = [family.eval_sums(model, conversation) for conversation in (first, second)]
        one_sequence = family.eval_sums(model, {key: packed[key] for key in ("input_ids", "labels")})
    targets = sum(conversation["tokens"] for conversation in alone)
    assert sums["tokens"] == targets == int((packed["labels"] != IGNORE_INDEX).sum())
    expected = sum(conversation["loss_sum"] for conversation in alone)
    assert sums["loss_sum"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert loss.item() == pytest.approx((expected / targets).item(), rel=1e-6)
    assert abs(one_sequence["loss_sum"].item() - expected.item()) > 1e-4


def test_resnet_divides_its_summed_loss_as_the_decoders_do():
    """Image labels are never masked in training, so no backend divides ResNet's loss; the family keeps
    the contract all the same: summed over the images, over their count, it is its own mean."""
    resnet = get_family("resnet")
    torch.manual_seed(0)
    section = {"family": "resnet", "preset": "resnet18", "num_classes": 10, "implementation": "transformers"}
    model = resnet.build(section)
    generator = torch.Generator().manual_seed(2)
    batch = {"pixel_values": torch.randn(3, 3, 32, 32, generator=generator), "labels": torch.tensor([1, 7, 7])}
    model.eval()
    with torch.no_grad():
        mean = resnet.compute_loss(model, batch)
        divided = resnet.compute_loss(model, batch, torch.tensor(3.0))
    torch.testing.assert_close(divided, mean)


@pytest.mark.parametrize("data_type", ["chat", "instruction"])
def test_data_with_masked_labels_is_refused_under_pipeline_parallelism(data_type: str):
    """DeepSpeed's pipeline engine would average micro-batch means and number positions itself: refused
    before launch, naming the field and the way out."""
    document = json.loads((ROOT / "configs" / "sft_llama_tiny.json").read_text())
    document["data"]["type"] = data_type
    document["parallel"] = {"pipeline_parallel_size": 2}
    cpu = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
    with pytest.raises(ConfigError) as caught:
        check_document(document, 2, cpu)
    refusals = [str(issue) for issue in caught.value.issues if issue.path == "data.type"]
    assert len(refusals) == 1 and "pipeline parallelism" in refusals[0], caught.value.issues
    assert "set parallel.pipeline_parallel_size to 1" in refusals[0]
