"""Checkpoints resumed on another layout (data-parallel size, ZeRO stage 1, 2 or 3, tensor and
pipeline split; under the accelerate backend any process count, DDP or FSDP; from either backend
to the other) continue the run they came from: the losses and learning rates of the next steps
match the uninterrupted run, and so do the weights and batch-norm statistics. Layouts that cannot
be converted are refused before anything loads, and an export moves weights between any two
layouts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.launch import Run, launch, launch_accelerate, read_run, run_single
from tests.support.shared_runs import GPT, GPT_STEPS, PP2_TP2, RESNET, Trained

# Six steps saved at step 3 under a warm-up schedule, as the shared runs the sources are
# (tests/support/shared_runs.py): a resume that lost the scheduler state would show in the learning rate.
STEPS = GPT_STEPS
LOSS_TOLERANCE = 1e-5


def resumed_from(
    source: Run,
    overrides: dict,
    output_dir: Path,
    nproc: int,
    accelerate: bool = False,
    config: str = GPT,
    training: dict = STEPS,
) -> Run:
    """`source` resumed from its step-3 checkpoint on the layout `overrides` give, with the training
    settings `source` ran with."""
    checkpoint = source.output_dir / "checkpoints" / "step00000003"
    overrides = {**training, **overrides, "trainer.resume": str(checkpoint)}
    if nproc > 1:
        if accelerate:
            return launch_accelerate(config, overrides, output_dir, nproc=nproc)
        return launch(config, overrides, output_dir, nproc=nproc)
    if accelerate:
        overrides["trainer.backend"] = "accelerate"
    # The ZeRO stage asked for is the loader under test, even on one process.
    overrides["trainer.single_rank_fast_path"] = False
    result = run_single(config, overrides, output_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_run(output_dir, result.stdout)


def resolved(run: Run) -> dict:
    return json.loads((run.output_dir / "resolved_config.json").read_text())


def assert_continues(resumed: Run, source: Run, how: str = "resumed through a universal checkpoint") -> None:
    """The resumed steps' losses and learning rates are the uninterrupted run's, and so are its
    final weights."""
    assert [record["step"] for record in resumed.records] == [4, 5, 6]
    for mine, theirs in zip(resumed.records, source.records[3:], strict=True):
        assert abs(mine["loss"] - theirs["loss"]) <= LOSS_TOLERANCE, (resumed.losses, source.losses)
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-6)
    assert how in resumed.stdout
    assert_same_weights(resumed, source)


def assert_same_weights(resumed: Run, source: Run, atol: float = 1e-5) -> None:
    """The final exports agree: every parameter and persistent buffer (batch-norm statistics too)."""
    final, expected = resumed.exported_state_dict(), source.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(scope="module")
def zero2(trained: Callable[[str], Trained]) -> Run:
    return trained("gpt_zero2").run


@pytest.fixture(scope="module")
def pipeline_tensor(trained: Callable[[str], Trained]) -> Run:
    """Two pipeline stages of two tensor shards each (PP2_TP2) on 4 ranks."""
    return trained("gpt_pp2_tp2").run


@pytest.mark.launch
def test_zero2_on_two_ranks_resumes_on_one(zero2: Run, tmp_path: Path):
    # One rank holds the same global batch of 4 with two accumulation steps.
    overrides = {"zero_optimization.stage": 2, "gradient_accumulation_steps": 2}
    assert_continues(resumed_from(zero2, overrides, tmp_path / "one", nproc=1), zero2)


@pytest.mark.launch
def test_zero2_resumes_as_zero1(zero2: Run, tmp_path: Path):
    assert_continues(resumed_from(zero2, {"zero_optimization.stage": 1}, tmp_path / "zero1", nproc=2), zero2)


@pytest.mark.launch
def test_pipeline_and_tensor_shards_resume_exactly_on_their_own_layout(pipeline_tensor: Run, tmp_path: Path):
    resumed = resumed_from(pipeline_tensor, PP2_TP2, tmp_path / "same", nproc=4)
    assert [record["step"] for record in resumed.records] == [4, 5, 6]
    assert resumed.losses == pipeline_tensor.losses[3:]
    assert "universal" not in resumed.stdout
    assert_same_weights(resumed, pipeline_tensor, atol=0.0)


@pytest.mark.launch
def test_pipeline_and_tensor_shards_resume_as_one_process(pipeline_tensor: Run, tmp_path: Path):
    """PP=2 x TP=2 -> PP=1 x TP=1: the stages' layers are renamed to the whole model's and the
    tensor shards joined; "auto" keeps the vocabulary the checkpoint padded for two shards."""
    resumed = resumed_from(pipeline_tensor, {"zero_optimization.stage": 1}, tmp_path / "single", nproc=1)
    assert_continues(resumed, pipeline_tensor)


@pytest.mark.launch
def test_llama_pipeline_and_tensor_shards_resume_as_one_process(trained: Callable[[str], Trained], tmp_path: Path):
    """Llama's pieces GPT has not: key/value projections split one head per shard, an untied head
    split by vocabulary rows on the last stage, rotary positions recomputed per stage. The universal
    conversion joins them into the one-process model, which trains on as the uninterrupted run."""
    source = trained("llama_pp2_tp2")
    overrides = {"zero_optimization.stage": 1}
    single = tmp_path / "single"
    resumed = resumed_from(source.run, overrides, single, nproc=1, config=source.config, training=source.training)
    assert_continues(resumed, source.run)


@pytest.mark.launch
def test_zero2_on_two_ranks_resumes_as_zero3_on_one(zero2: Run, tmp_path: Path):
    """DeepSpeed's ZeRO-3 loader reads engine and optimizer state under ZeRO-3's own file names
    and layout; the loading view supplies them."""
    overrides = {"zero_optimization.stage": 3, "gradient_accumulation_steps": 2}
    resumed = resumed_from(zero2, overrides, tmp_path / "zero3", nproc=1)
    assert_continues(resumed, zero2)
    # DeepSpeed's ZeRO-3 universal loader shares one Adam step among the sub-groups (the losses above
    # show it mended) and gives every group the first group's hyperparameters: the biases and
    # gains must go on undecayed.
    (optimizer_file,) = (resumed.output_dir / "checkpoints" / "step00000006").glob("*rank_0_*optim_states.pt")
    saved = torch.load(optimizer_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    decays = [group["weight_decay"] for group in saved["optimizer_state_dict"]["param_groups"]]
    assert decays == [resolved(zero2)["optimizer"]["params"]["weight_decay"], 0.0]


@pytest.fixture(scope="module")
def zero3(trained: Callable[[str], Trained]) -> Run:
    return trained("gpt_zero3").run


@pytest.mark.launch
@pytest.mark.parametrize("stage,nproc", [(2, 1), (1, 2)], ids=["zero2_on_one", "zero1_on_two"])
def test_zero3_on_two_ranks_resumes_as_zero1_or_zero2(zero3: Run, stage: int, nproc: int, tmp_path: Path):
    """DeepSpeed's conversion of a ZeRO-3 checkpoint is written for ZeRO-3's loader only; the
    engine rewrites it so ZeRO-1/2's loader reads the weights, both moments, the step and the
    decay of each group."""
    overrides = {"zero_optimization.stage": stage, "gradient_accumulation_steps": 2 // nproc}
    resumed = resumed_from(zero3, overrides, tmp_path / f"zero{stage}", nproc=nproc)
    assert_continues(resumed, zero3)
    (optimizer_file,) = (resumed.output_dir / "checkpoints" / "step00000006").glob("*rank_0_*optim_states.pt")
    saved = torch.load(optimizer_file, map_location="cpu", weights_only=False)["optimizer_state_dict"]
    decays = [group["weight_decay"] for group in saved["base_optimizer_state"]["param_groups"]]
    assert decays == [resolved(zero3)["optimizer"]["params"]["weight_decay"], 0.0]


@pytest.mark.launch
def test_zero3_sub_groups_each_keep_their_own_adam_step(zero2: Run, tmp_path: Path):
    """Optimizer groups that ZeRO-3 steps in several sub-groups each, as it steps any group of more
    than sub_group_size (1e9) elements. DeepSpeed's universal loader hands every sub-group the same
    step tensor; without the engine's mend (one step per sub-group, whatever its group) the loss was
    3.2e-3 off by the second resumed step."""
    overrides = {"zero_optimization.stage": 3, "zero_optimization.sub_group_size": 4096}
    resumed = resumed_from(zero2, {**overrides, "gradient_accumulation_steps": 2}, tmp_path / "zero3", nproc=1)
    assert_continues(resumed, zero2)


@pytest.fixture(scope="module")
def fsdp(trained: Callable[[str], Trained]) -> Run:
    return trained("gpt_fsdp").run


# torch.distributed.checkpoint reshards on load, so the accelerate backend needs no conversion.
ACCELERATE_RESHAPES = {
    "one_process": ({"zero_optimization.stage": 0, "gradient_accumulation_steps": 2}, 1),
    "ddp": ({"zero_optimization.stage": 0}, 2),
    "fsdp_grad_op": ({"zero_optimization.stage": 2}, 2),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(ACCELERATE_RESHAPES))
def test_accelerate_fsdp_on_two_ranks_resumes_on_another_layout(fsdp: Run, name: str, tmp_path: Path):
    """The tiny GPT's odd vocabulary leaves FSDP's two pieces of the embedding unequal; a whole
    tensor (one process, DDP) or the other wrapper's pieces are read back from them."""
    overrides, nproc = ACCELERATE_RESHAPES[name]
    resumed = resumed_from(fsdp, overrides, tmp_path / name, nproc=nproc, accelerate=True)
    assert_continues(resumed, fsdp, how="resumed on another layout")


@pytest.mark.launch
def test_accelerate_one_process_resumes_as_fsdp_on_two_ranks(tmp_path: Path):
    """Whole tensors cut into FSDP's row pieces on load, Adam's moments with them."""
    single = {**STEPS, "trainer.backend": "accelerate", "zero_optimization.stage": 0, "gradient_accumulation_steps": 2}
    result = run_single(GPT, single, tmp_path / "one")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    source = read_run(tmp_path / "one", result.stdout)
    resumed = resumed_from(source, {"zero_optimization.stage": 3}, tmp_path / "fsdp", nproc=2, accelerate=True)
    assert_continues(resumed, source, how="resumed on another layout")


# A DeepSpeed checkpoint resumed under the accelerate backend, through its universal form.
DEEPSPEED_TO_ACCELERATE = {
    "zero2_as_fsdp_on_two": ("zero2", {"zero_optimization.stage": 3}, 2),
    "zero3_as_one_process": ("zero3", {"zero_optimization.stage": 0, "gradient_accumulation_steps": 2}, 1),
    # The pipeline run's global batch of 2 (one data-parallel replica) as one sample per DDP rank.
    "pipeline_tensor_as_ddp_on_two": (
        "pipeline_tensor",
        {"zero_optimization.stage": 0, "train_micro_batch_size_per_gpu": 1},
        2,
    ),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(DEEPSPEED_TO_ACCELERATE))
def test_deepspeed_checkpoint_resumes_under_accelerate(name: str, request: pytest.FixtureRequest, tmp_path: Path):
    """Whole fp32 weights and Adam moments from the universal form, cut by torch into FSDP's row
    pieces or DDP's whole tensors; the LR schedule and step from DeepSpeed's engine state."""
    fixture, overrides, nproc = DEEPSPEED_TO_ACCELERATE[name]
    source = request.getfixturevalue(fixture)
    resumed = resumed_from(source, overrides, tmp_path / name, nproc=nproc, accelerate=True)
    assert_continues(resumed, source)


@pytest.fixture(scope="module")
def zero0(trained: Callable[[str], Trained]) -> Run:
    return trained("gpt_zero0").run


# fp32 ZeRO-0 keeps torch's own optimizer state, which DeepSpeed's converter does not read.
ZERO0_RESHAPES = {
    "zero2_on_one": ({"zero_optimization.stage": 2, "gradient_accumulation_steps": 2}, 1, False),
    "fsdp_on_two": ({"zero_optimization.stage": 3}, 2, True),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(ZERO0_RESHAPES))
def test_zero0_checkpoint_resumes_on_another_layout(zero0: Run, name: str, tmp_path: Path):
    """The whole weights and torch's optimizer state in ZeRO-0's model states, named by the
    optimizer order the save recorded, written as a universal checkpoint."""
    overrides, nproc, accelerate = ZERO0_RESHAPES[name]
    resumed = resumed_from(zero0, overrides, tmp_path / name, nproc=nproc, accelerate=accelerate)
    assert_continues(resumed, zero0)


# An accelerate checkpoint resumed under DeepSpeed, through a universal form made from it.
ACCELERATE_TO_DEEPSPEED = {
    "zero3_on_one": ({"zero_optimization.stage": 3, "gradient_accumulation_steps": 2}, 1),
    # Two pipeline stages of one data-parallel replica: the FSDP run's global batch of 4 in two steps.
    "pipeline_on_two": (
        {"zero_optimization.stage": 1, "parallel.pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
        2,
    ),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(ACCELERATE_TO_DEEPSPEED))
def test_accelerate_checkpoint_resumes_under_deepspeed(fsdp: Run, name: str, tmp_path: Path):
    """torch's DCP reader joins FSDP's row pieces into whole tensors, written as a universal
    checkpoint that DeepSpeed cuts into its partitions or pipeline stages, under the names the
    accelerate run recorded."""
    overrides, nproc = ACCELERATE_TO_DEEPSPEED[name]
    resumed = resumed_from(fsdp, overrides, tmp_path / name, nproc=nproc)
    assert_continues(resumed, fsdp)


# (the shared ResNet run resumed, resume overrides, resume process count, resume under accelerate):
# ZeRO-2 on 2 ranks, two pipeline stages under ZeRO-1, FSDP on 2 ranks (tests/support/shared_runs.py).
BATCH_NORM_RESHAPES = {
    "zero2_as_zero1": ("resnet_zero2", {"zero_optimization.stage": 1}, 2, False),
    "pipeline_as_accelerate": ("resnet_pp2", {"zero_optimization.stage": 0}, 1, True),
    "fsdp_as_zero2": ("resnet_fsdp", {"zero_optimization.stage": 2}, 2, False),
}


@pytest.mark.launch
@pytest.mark.parametrize("name", sorted(BATCH_NORM_RESHAPES))
def test_batch_norm_statistics_survive_a_reshape(name: str, trained: Callable[[str], Trained], tmp_path: Path):
    """The universal form holds parameters only, and DeepSpeed's universal load skips the module
    state: its ResNet resumed with fresh running statistics (an eval loss of 2.080 where the
    uninterrupted run had 2.159). The engine restores them from the saved module states, per
    tensor-parallel rank (ZeRO-2 on two ranks) or per pipeline layer, or from the engine state of
    an accelerate checkpoint's conversion, and, on as many ranks as saved them, each rank's own copy
    (`buffers/rank<R>.pt`): the evaluation matches too."""
    shared, overrides, nproc, accelerate = BATCH_NORM_RESHAPES[name]
    source = trained(shared)
    resumed = resumed_from(
        source.run, overrides, tmp_path / "resumed", nproc, accelerate, config=RESNET, training=source.training
    )
    assert_continues(resumed, source.run)
    assert resumed.records[-1]["eval_loss"] == pytest.approx(source.run.records[-1]["eval_loss"], abs=1e-5)


@pytest.mark.launch
def test_an_impossible_reshape_is_refused_before_loading(zero2: Run, tmp_path: Path):
    checkpoint = zero2.output_dir / "checkpoints" / "step00000003"
    # Twice the micro-batches on one rank keep the global batch, which must not change on a resume.
    overrides = {
        **STEPS,
        "zero_optimization.stage": 0,
        "gradient_accumulation_steps": 2,
        "trainer.resume": str(checkpoint),
    }
    result = run_single(GPT, overrides, tmp_path / "zero0")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "ZeRO-0 keeps none" in result.stderr and "model.init_from" in result.stderr
    assert not (tmp_path / "zero0" / "logs").exists()  # refused before any process group started


@pytest.mark.launch
@pytest.mark.parametrize("target", ["one process", "ZeRO-3 on 2 ranks"])
def test_an_export_moves_weights_to_another_layout(pipeline_tensor: Run, target: str, tmp_path: Path):
    """The PP=2 x TP=2 run's export starts a single process, and a ZeRO-3 run whose ranks load it
    already partitioned (transformers' `from_pretrained` inside zero.Init). One step at a learning
    rate of 1e-30 moves no weight by as much as its last bit, so the new export equals the one imported."""
    overrides = {
        "model.init_from": str(pipeline_tensor.output_dir / "export"),
        "model.vocab_size": resolved(pipeline_tensor)["model"]["vocab_size"],
        "optimizer.params.lr": 1e-30,
        "trainer.max_steps": 1,
    }
    if target == "one process":
        result = run_single(GPT, overrides, tmp_path / "imported")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        imported = read_run(tmp_path / "imported").exported_state_dict()
    else:
        imported = launch(GPT, {**overrides, "zero_optimization.stage": 3}, tmp_path / "imported").exported_state_dict()
    expected = pipeline_tensor.exported_state_dict()
    assert imported.keys() == expected.keys()
    for name in imported:
        torch.testing.assert_close(imported[name], expected[name], rtol=0, atol=1e-12, msg=name)
