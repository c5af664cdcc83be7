"""The loss of a step is the mean over the target tokens of its whole global batch (issue 42, item 3):
chat data, whose prompts and padding are masked, trained for real on 1 rank accumulating 4
micro-batches, 2 ranks accumulating 2, 4 ranks accumulating none and 2 ranks splitting every
conversation in two (Ulysses sequence parallelism, accumulating 4) (ZeRO-2), and on 2 ranks of
accelerate's DDP accumulating 4 micro-batches of one conversation each, gives the same losses and
weights, and those of plain transformers and torch's AdamW over the same global batches in one
process. The evaluation counts every validation conversation's targets once, and the repeats that
fill the last batches of larger layouts nothing."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from data import global_batch_indices
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data
from models.labels import IGNORE_INDEX
from tests.support.compare import max_loss_difference
from tests.support.launch import ROOT, Run, _text, launch, launch_accelerate
from tests.support.pretrained import ARCHITECTURE, write_tiny_llama

CONFIG = "configs/sft_llama_tiny.json"
TOLERANCE = 1e-5  # the bound, on losses and weights alike
GLOBAL_BATCH = 8


@dataclass(frozen=True)
class Layout:
    launcher: Callable[..., Run]
    ranks: int
    micro_batch: int
    sequence: int = 1  # parallel.sequence_parallel_size: ranks that split each conversation

    @property
    def overrides(self) -> dict[str, object]:
        replicas = self.ranks // self.sequence
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": GLOBAL_BATCH // (self.micro_batch * replicas),
            "parallel.sequence_parallel_size": self.sequence,
        }


DEEPSPEED_LAYOUTS = [Layout(launch, 1, 2), Layout(launch, 2, 2), Layout(launch, 4, 2), Layout(launch, 2, 2, sequence=2)]
DDP_LAYOUT = Layout(launch_accelerate, 2, 1)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def common_overrides(pretrained: Path, eval_batches: int) -> dict[str, object]:
    """The config's chat sample with the pretrained model's tokenizer and template, unpacked (each
    micro-batch padded to its longest), unclipped, 3 steps, evaluated once at the end over every
    validation conversation."""
    return {
        "model.init_from": str(pretrained),
        "model.max_position_embeddings": ARCHITECTURE["max_position_embeddings"],
        "data.tokenizer": str(pretrained),
        "data.chat_template": None,
        "data.seq_len": ARCHITECTURE["max_position_embeddings"],
        "data.packing": False,
        "zero_optimization.stage": 2,
        "trainer.single_rank_fast_path": False,
        "gradient_clipping": 0.0,
        "trainer.max_steps": 3,
        "trainer.log_interval": 1,
        "trainer.eval_batches": eval_batches,
        "trainer.sample_tokens": 0,
    }


def summed_loss(model: torch.nn.Module, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """transformers' logits of one conversation alone, unpadded; cross-entropy summed over its targets."""
    logits = model(input_ids=sample["input_ids"][None]).logits[0].float()
    labels = sample["labels"]
    targets = int((labels != IGNORE_INDEX).sum())
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"), targets


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    model: torch.nn.Module
    eval_loss: float
    validation_samples: int
    # Step 1's loss as the mean of each 2-sample micro-batch's own mean: what the fix replaced.
    micro_batch_means: float
    micro_batch_targets: list[int]


def reference_run(pretrained: Path) -> Reference:
    overrides = {**common_overrides(pretrained, 1), **DEEPSPEED_LAYOUTS[0].overrides}
    sets = [f"{key}={_text(value)}" for key, value in overrides.items()]
    config = load_config(ROOT / CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1))
    bundle = load_data(config)
    torch.set_num_threads(config.trainer.threads_per_rank)
    model = LlamaForCausalLM.from_pretrained(pretrained, dtype=torch.float32).train()
    params = config.document["optimizer"]["params"]
    matrices = [parameter for parameter in model.parameters() if parameter.ndim >= 2]
    vectors = [parameter for parameter in model.parameters() if parameter.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}],
        lr=params["lr"],
        betas=params["betas"],
        eps=params["eps"],
        weight_decay=params["weight_decay"],
    )
    losses: list[float] = []
    micro_batch_means, micro_batch_targets = 0.0, []
    for step in range(config.trainer.max_steps):
        indices = global_batch_indices(len(bundle.train), step, GLOBAL_BATCH, config.trainer.seed)
        sums, counts = zip(*(summed_loss(model, bundle.train[index]) for index in indices), strict=True)
        loss = torch.stack(sums).sum() / sum(counts)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step == 0:
            pairs = range(0, GLOBAL_BATCH, 2)
            micro_batch_targets = [counts[start] + counts[start + 1] for start in pairs]
            micro_batch_means = sum(
                (sums[start] + sums[start + 1]).item() / (counts[start] + counts[start + 1]) for start in pairs
            ) / len(pairs)
    model.eval()
    with torch.no_grad():
        sums, counts = zip(*(summed_loss(model, sample) for sample in bundle.validation), strict=True)
    eval_loss = torch.stack(sums).sum().item() / sum(counts)
    return Reference(losses, model, eval_loss, len(bundle.validation), micro_batch_means, micro_batch_targets)


@pytest.fixture(scope="module")
def reference(pretrained: Path) -> Reference:
    return reference_run(pretrained)


def evaluated_batches(reference: Reference) -> int:
    """Batches per rank that cover every validation conversation in every layout (the smallest reads 2
    conversations a batch); the larger fill theirs with repeats, which must weigh nothing."""
    return math.ceil(reference.validation_samples / 2)


def assert_matches(run: Run, reference: Reference) -> None:
    assert len(run.losses) == 3
    assert max_loss_difference(run.losses, reference.losses) <= TOLERANCE, (run.losses, reference.losses)
    assert abs(run.records[-1]["eval_loss"] - reference.eval_loss) <= TOLERANCE
    exported = run.exported_state_dict()
    for name, parameter in reference.model.named_parameters():
        torch.testing.assert_close(exported[name], parameter.detach(), rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.launch
def test_ranks_and_accumulation_train_the_global_token_mean(pretrained: Path, reference: Reference, tmp_path: Path):
    """1 x 4, 2 x 2, 4 x 1 (ranks x accumulation) and 2 ranks splitting each conversation x 4 under
    ZeRO-2: equal losses and weights, and the reference's. The batches have teeth: their micro-batches
    hold unequal counts of targets, and the mean of the micro-batches' own means, what each layout
    trained before, is far from the reference."""
    assert len(set(reference.micro_batch_targets)) > 1, reference.micro_batch_targets
    assert abs(reference.micro_batch_means - reference.losses[0]) > 10 * TOLERANCE
    common = common_overrides(pretrained, evaluated_batches(reference))
    runs = [
        layout.launcher(
            CONFIG,
            {**common, **layout.overrides},
            tmp_path / f"ranks{layout.ranks}_sequence{layout.sequence}",
            nproc=layout.ranks,
        )
        for layout in DEEPSPEED_LAYOUTS
    ]
    first = runs[0]
    for run in runs:
        assert "deepspeed backend, ZeRO stage 2" in run.stdout
        assert_matches(run, reference)
        assert max_loss_difference(run.losses, first.losses) <= TOLERANCE
        exported, kept = run.exported_state_dict(), first.exported_state_dict()
        for name, tensor in kept.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.launch
def test_ddp_accumulating_single_conversations_trains_the_global_token_mean(
    pretrained: Path, reference: Reference, tmp_path: Path
):
    """accelerate's DDP on 2 ranks, each accumulating 4 micro-batches of one conversation (so no
    padding at all): its own accumulation and the DDP average give the same global mean."""
    overrides = {**common_overrides(pretrained, evaluated_batches(reference)), **DDP_LAYOUT.overrides}
    overrides["zero_optimization.stage"] = 0
    run = DDP_LAYOUT.launcher(CONFIG, overrides, tmp_path / "ddp", nproc=DDP_LAYOUT.ranks)
    assert "accelerate backend: ddp on 2 process(es)" in run.stdout
    assert_matches(run, reference)
