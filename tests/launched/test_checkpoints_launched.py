"""Checkpoints you can trust: published only when every rank has written, older ones pruned, and a
run killed mid-training or mid-save resumes to bit-identical weights (dropout on, so the RNG
states must come back too, and so must each rank's batch-norm statistics)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from engine.checkpoints.store import PARTIAL, latest_tag, step_tag
from engine.launch.signals import EXIT_PREEMPTED
from tests.support.launch import deepspeed_launcher, launch, read_run, run_launcher, run_single
from tests.support.monitor import MONITORS, assert_monitors_rewound
from tests.support.shared_runs import Trained

GPT = "configs/tiny_gpt.json"
# Dropout draws from every rank's generator each step: resumes are exact only if RNG states are.
RUN = {
    "zero_optimization.stage": 2,
    "model.dropout": 0.1,
    "trainer.max_steps": 8,
    "trainer.eval_interval": 3,
    "trainer.save_interval": 2,
    "trainer.keep_checkpoints": 2,
    **MONITORS,
}


@pytest.mark.launch
def test_a_resume_with_no_step_left_saves_in_its_own_layout_and_exports(tmp_path: Path):
    """Resuming another run's checkpoint at its last step trains nothing: the state it loaded is
    saved as this run's (here converted from ZeRO-2 on 2 ranks to one process) and exported. The
    source run is sent SIGTERM as its export starts: its last step is saved, so it writes the export,
    skips the text sample and ends with 0."""
    fault = {"ENGINE_FAULT": "signal,rank=0,step=3,at=export,sig=SIGTERM"}
    source_run = {"zero_optimization.stage": 2, "trainer.max_steps": 3, "trainer.sample_tokens": 16}
    finished = run_launcher(deepspeed_launcher(2), GPT, source_run, tmp_path / "source", fault)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "SIGTERM received: the export is written, text sampling skipped" in finished.stdout
    assert "sample:" not in finished.stdout
    assert "SIGTERM received after the last step, which is saved: ending (exit code 0)" in finished.stdout
    source = read_run(tmp_path / "source")
    overrides = {
        "zero_optimization.stage": 1,
        "gradient_accumulation_steps": 2,
        "trainer.max_steps": 3,
        "trainer.resume": str(source.output_dir),
    }
    result = run_single(GPT, overrides, tmp_path / "converted")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert latest_tag(tmp_path / "converted" / "checkpoints") == "step00000003"
    converted = read_run(tmp_path / "converted").exported_state_dict()
    for name, tensor in source.exported_state_dict().items():
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    launch(GPT, RUN, output_dir)
    return output_dir


def assert_same_training(resumed: Path, straight: Path, from_step: int, monitors: bool = True) -> None:
    resumed_run, straight_run = read_run(resumed), read_run(straight)
    resumed_records = [record for record in resumed_run.records if record["step"] > from_step]
    assert [record["step"] for record in resumed_records] == list(range(from_step + 1, 9))
    assert [record["loss"] for record in resumed_records] == straight_run.losses[from_step:]
    final, expected = resumed_run.exported_state_dict(), straight_run.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name
    # The crashed run wrote the steps after the checkpoint already; the resumed one writes them again.
    if monitors:
        assert_monitors_rewound(resumed, straight, exact=("loss", "lr"))


@pytest.mark.launch
def test_keep_checkpoints_prunes_older_saves(uninterrupted: Path):
    root = uninterrupted / "checkpoints"
    assert sorted(path.name for path in root.iterdir() if path.is_dir()) == ["step00000006", "step00000008"]
    assert latest_tag(root) == "step00000008"
    assert all((root / "step00000008" / "rng" / f"rank{rank}.pt").is_file() for rank in (0, 1))


def stop(run: dict, fault: str, output_dir: Path) -> CompletedProcess:
    """`run` on 2 ranks under the deepspeed launcher with the fault ENGINE_FAULT injects, to its end."""
    return run_launcher(deepspeed_launcher(2), GPT, run, output_dir, {"ENGINE_FAULT": fault})


def assert_so_far_as_uninterrupted(output_dir: Path, uninterrupted: Path) -> None:
    """The steps the metrics hold (rewound at each resume) are the uninterrupted run's, loss for loss:
    a stopped run that was itself resumed trained its steps exactly too."""
    losses = read_run(output_dir).losses
    assert losses == read_run(uninterrupted).losses[: len(losses)], losses


def assert_stopped_by_signal(stopped: CompletedProcess, fault: str, saved_at: int, output_dir: Path) -> None:
    # The ranks exit 75 (saved on preemption); the deepspeed launcher passes that on, except when it
    # was signalled itself (its own handler exits 1 once its ranks are gone).
    assert stopped.returncode == (1 if "to=launcher" in fault else EXIT_PREEMPTED), stopped.stderr[-3000:]
    assert latest_tag(output_dir / "checkpoints") == step_tag(saved_at)
    assert f"saved step {saved_at} and stopped (exit code 75)" in stopped.stdout
    assert read_run(output_dir).records[-1]["step"] <= saved_at


# Each stop below is a launch, and a launch costs the CI machine 10-20 s: one run is stopped several
# times, each time resumed from what the stop before left, so each resume both proves itself (its
# steps up to the next stop are the uninterrupted run's) and meets the next fault.


@pytest.mark.launch
def test_a_save_cut_short_leaves_the_previous_checkpoint_and_the_run_resumes_bit_identically(
    uninterrupted: Path, tmp_path: Path
):
    """Three ways the step-4 save dies before it is published: rank 1 killed once its own files are
    written; a second SIGTERM during the save, which ends the job at once; under trainer.async_save,
    rank 1 SIGKILLed on its writer thread part-way through the files. Each leaves step 2 the latest,
    and the run resumes from it to the uninterrupted run's steps and weights."""
    root = tmp_path / "checkpoints"
    killed = stop(RUN, "kill,rank=1,step=4,at=save", tmp_path)
    assert killed.returncode != 0
    assert latest_tag(root) == "step00000002"
    assert (root / ("step00000004" + PARTIAL)).is_dir() and not (root / "step00000004").exists()

    resumed = {**RUN, "trainer.resume": True}
    ended = stop(resumed, "signal,rank=1,step=4,at=save,sig=SIGTERM,times=2", tmp_path)
    assert ended.returncode not in (0, EXIT_PREEMPTED)
    assert latest_tag(root) == "step00000002"
    assert not (root / "step00000004").exists()
    assert_so_far_as_uninterrupted(tmp_path, uninterrupted)

    background = {**resumed, "trainer.async_save": True}
    killed = stop(background, "kill,rank=1,step=4,at=write", tmp_path)
    assert killed.returncode != 0
    assert "injects 'kill' at write 4" in (tmp_path / "logs" / "rank1.log").read_text()
    assert latest_tag(root) == "step00000002"
    assert (root / ("step00000004" + PARTIAL)).is_dir() and not (root / "step00000004").exists()
    assert_so_far_as_uninterrupted(tmp_path, uninterrupted)

    launch(GPT, background, tmp_path)
    assert not (root / ("step00000004" + PARTIAL)).exists()  # the next save cleared it
    assert_same_training(tmp_path, uninterrupted, from_step=2)


@pytest.mark.launch
def test_signals_save_and_a_killed_run_keeps_its_last_save_each_resumed_bit_identically(
    uninterrupted: Path, tmp_path: Path
):
    """Four stops in turn: SIGTERM while the step-4 save is written (the save completes, and the run
    stops there); rank 1 SIGKILLed in step 5 (step 4 stays the latest); SIGTERM to the deepspeed
    launcher after step 5, which passes it to every rank (step 5 is saved); SIGUSR1 (SLURM's
    --signal) to rank 1 alone as the evaluation after step 6 starts (cut short on every rank, then
    the step-6 save, written in the background and waited for, then the exit). The run resumed after
    the last trains to the uninterrupted run's steps and weights."""
    fault = "signal,rank=1,step=4,at=save,sig=SIGTERM"
    assert_stopped_by_signal(stop(RUN, fault, tmp_path), fault, 4, tmp_path)

    resumed = {**RUN, "trainer.resume": True}
    killed = stop(resumed, "kill,rank=1,step=5", tmp_path)
    assert killed.returncode != 0
    assert latest_tag(tmp_path / "checkpoints") == "step00000004"
    assert_so_far_as_uninterrupted(tmp_path, uninterrupted)

    fault = "signal,rank=0,step=5,sig=SIGTERM,to=launcher"
    assert_stopped_by_signal(stop(resumed, fault, tmp_path), fault, 5, tmp_path)
    assert_so_far_as_uninterrupted(tmp_path, uninterrupted)

    background = {**resumed, "trainer.async_save": True}
    fault = "signal,rank=1,step=6,at=eval,sig=SIGUSR1"
    assert_stopped_by_signal(stop(background, fault, tmp_path), fault, 6, tmp_path)
    assert all("eval_loss" not in record for record in read_run(tmp_path).records if record["step"] == 6)
    assert_so_far_as_uninterrupted(tmp_path, uninterrupted)

    launch(GPT, background, tmp_path)
    # An evaluation cut short is not logged, so the monitor rows differ from the uninterrupted run's
    # (the test above holds them to it).
    assert_same_training(tmp_path, uninterrupted, from_step=6, monitors=False)


@pytest.mark.launch
def test_a_resume_trains_at_the_configs_learning_rate(uninterrupted: Path, tmp_path: Path):
    """What the advice after a loss spike asks for: resume from the last good checkpoint with a lower
    optimizer.params.lr. DeepSpeed's load restores the saved param groups, whose lr the run then kept."""
    checkpoint = uninterrupted / "checkpoints" / "step00000006"
    resumed = launch(GPT, {**RUN, "optimizer.params.lr": 1e-4, "trainer.resume": str(checkpoint)}, tmp_path)
    assert [record["step"] for record in resumed.records] == [7, 8]
    assert [record["lr"] for record in resumed.records] == [1e-4, 1e-4]
    assert resumed.losses[1] != read_run(uninterrupted).losses[7]


@pytest.mark.launch
@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_a_damaged_checkpoint_is_refused_before_any_process_group(uninterrupted: Path, damage: str, tmp_path: Path):
    """A partition cut short (a full disk, a copy between machines interrupted) or deleted by hand:
    one message naming trainer.resume and the checkpoint still good, where DeepSpeed would fail on
    one rank with a zip-reader traceback after every rank had started."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    tag = tmp_path / "run" / "checkpoints" / "step00000008"
    (partition,) = tag.glob("zero_pp_rank_1_*optim_states.pt")
    if damage == "truncated":
        os.truncate(partition, partition.stat().st_size // 2)
        expected = f"{partition.name} is not a complete torch.save archive"
    else:
        partition.unlink()
        expected = "the optimizer partition of data-parallel rank 1 (model-parallel rank 0) is missing"
    result = run_single(GPT, {**RUN, "gradient_accumulation_steps": 2, "trainer.resume": True}, tmp_path / "run")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"trainer.resume: checkpoint {tag} is damaged: {expected}; resume from an earlier one (step00000006)" in (
        result.stderr
    )
    assert "Traceback" not in result.stderr and "init_distributed" not in result.stdout + result.stderr


@pytest.mark.launch
@pytest.mark.parametrize("name", ["resnet_zero2", "resnet_fsdp"], ids=["deepspeed_zero2", "accelerate_fsdp"])
def test_each_rank_resumes_its_own_batch_norm_statistics(name: str, trained: Callable[[str], Trained], tmp_path: Path):
    """Every rank updates its running statistics from its own samples, and DeepSpeed's and torch's
    checkpoints keep one rank's; without the engine's per-rank copies, rank 1 resumed with rank 0's
    and the final evaluation differed (2.3349 against 2.3309 under DeepSpeed, 2.3300 against 2.3310
    under FSDP). The ResNet runs of tests/support/shared_runs.py, resumed on their own layout."""
    source = trained(name)
    straight = source.run
    checkpoint = straight.output_dir / "checkpoints" / "step00000003"
    assert all((checkpoint / "buffers" / f"rank{rank}.pt").is_file() for rank in (0, 1))
    resumed = source.launch_again({**source.overrides, "trainer.resume": str(checkpoint)}, tmp_path / "resumed")
    assert resumed.losses == straight.losses[3:]
    assert resumed.records[-1]["eval_loss"] == straight.records[-1]["eval_loss"]


def test_a_resume_on_a_corpus_with_other_characters_stops_before_any_process_group(tmp_path: Path):
    """A char tokenizer numbers the corpus's characters: the same count of other characters would
    give every id another meaning, and the vocabulary size alone would not notice."""
    (tmp_path / "first.txt").write_text("abcdefgh " * 400)
    (tmp_path / "second.txt").write_text("abcdefgz " * 400)
    run = {"data.path": str(tmp_path / "first.txt"), "trainer.max_steps": 2, "trainer.save_interval": 2}
    first = run_single(GPT, {**run, "trainer.export": False}, tmp_path / "run")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_single(
        GPT, {**run, "data.path": str(tmp_path / "second.txt"), "trainer.resume": True}, tmp_path / "run"
    )
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    assert "data.tokenizer: checkpoint" in resumed.stderr and "another tokenizer's ids" in resumed.stderr
    assert "init_distributed" not in resumed.stdout + resumed.stderr


@pytest.mark.launch
def test_zero3_checkpoints_hold_the_gathered_weights_when_asked(trained: Callable[[str], Trained]):
    """`stage3_gather_16bit_weights_on_model_save` puts DeepSpeed's gathered state dict in every
    checkpoint; at the last step it is the very weights the export holds. Saved in the background
    (trainer.async_save): the gathered file, ZeRO-3's shards and the export read from them agree.
    The ZeRO-3 run of tests/support/shared_runs.py, which asks for both."""
    zero3 = trained("gpt_zero3")
    asked = {"zero_optimization.stage3_gather_16bit_weights_on_model_save": True, "trainer.async_save": True}
    assert zero3.overrides.items() >= asked.items()
    run, last = zero3.run, step_tag(zero3.overrides["trainer.max_steps"])
    gathered = torch.load(run.output_dir / "checkpoints" / last / "pytorch_model.bin", weights_only=True)
    exported = run.exported_state_dict()
    assert exported.keys() <= gathered.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0, msg=name)
