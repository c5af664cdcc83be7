"""Ulysses sequence parallelism (issue 43) is exact: the tiny Llama trained with each sequence split
over 2 ranks, under ZeRO-1, 2 and 3, and split over 2 ranks in each of 2 data replicas (4 ranks,
ZeRO-3 with its optimizer offloaded), gives the losses, gradient norms, weights and validation loss
of one process training on the whole sequences (tests/support/reference.py), within 1e-5.

The rows carry the features the issue names beside it (accumulation, activation checkpointing, the
tiled MLP and loss, offload), so each launch proves several things. The ZeRO-1 row saves at step 3:
a resume on its own layout, and one on 4 ranks splitting each sequence 4 ways (through the universal
form), repeat its steps 4-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.compare import (
    assert_eval_matches,
    assert_grad_norms_match,
    assert_weights_match,
    max_loss_difference,
)
from tests.support.launch import Run, launch
from tests.support.reference import ReferenceRun, reference_run

CONFIG = "configs/llama_tiny.json"
TOLERANCE = 1e-5  # the bound, on losses and weights alike
# Six steps of two accumulated micro-batches, saved at step 3, one thread per rank; unclipped, so
# the gradient-norm row is the raw norm each layout computes (a wrong scale could not hide in clipping).
TRAINING = {
    "trainer.max_steps": 6,
    "trainer.save_interval": 3,
    "trainer.threads_per_rank": 1,
    "trainer.sample_tokens": 0,
    "trainer.single_rank_fast_path": False,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.0,
}
ROWS = {
    "zero1": ({"zero_optimization.stage": 1}, 2),
    # Slices of 64 positions, twice the model's width: the tiled MLP cuts each into 2 pieces.
    "zero2_tiled": (
        {
            "zero_optimization.stage": 2,
            "model.tiled_mlp": True,
            "model.loss": "tiled",
            "model.max_position_embeddings": 128,
            "data.seq_len": 128,
        },
        2,
    ),
    "zero3_checkpointed": ({"zero_optimization.stage": 3, "model.activation_checkpointing": True}, 2),
    "zero3_offload_dp2": (
        {"zero_optimization.stage": 3, "zero_optimization.offload_optimizer.device": "cpu"},
        4,
    ),
}


def overrides(row: str, sequence: int = 2) -> dict[str, object]:
    return {**TRAINING, **ROWS[row][0], "parallel.sequence_parallel_size": sequence}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each row trained once for the module."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    return {row: launch(CONFIG, overrides(row), root / row, nproc=ranks) for row, (_, ranks) in ROWS.items()}


@pytest.mark.launch
@pytest.mark.parametrize("row", list(ROWS))
def test_sequence_parallel_equals_one_process(runs: dict[str, Run], row: str):
    """Losses, gradient norms (the row that shows a wrong gradient scale), weights and the
    validation loss equal one process's on whole sequences; the start-up table names each rank's
    sequence shard."""
    run, ranks = runs[row], ROWS[row][1]
    # One process reads the micro-batches of every data replica (world / SP of them) in turn.
    reference: ReferenceRun = reference_run(CONFIG, overrides(row), world_size=ranks)
    assert f"rank layout: {ranks // 2} data-parallel replica(s) x 2 sequence shard(s)" in run.stdout
    assert f"rank {ranks - 1}: data replica {ranks // 2}/{ranks // 2}, sequence shard 2/2" in run.stdout
    assert max_loss_difference(run.losses, reference.losses) <= TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms, rtol=TOLERANCE)
    assert_weights_match(run.exported_state_dict(), reference.model, atol=TOLERANCE)
    # The export, loaded by transformers, scores the validation set as the run itself did.
    assert_eval_matches(run.records, reference.eval_loss, TOLERANCE)
    assert_eval_matches(run.records, reference.evaluate(_load_export(run)), TOLERANCE)


def _load_export(run: Run):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run.output_dir / "export").eval()


@pytest.mark.launch
@pytest.mark.parametrize(("sequence", "ranks"), [(2, 2), (4, 4)], ids=["same_layout", "sp4_universal"])
def test_resume_repeats_the_steps_on_any_sequence_degree(
    runs: dict[str, Run], tmp_path: Path, sequence: int, ranks: int
):
    """The ZeRO-1 row's step-3 checkpoint resumed with each sequence split 2 ways (loaded as saved)
    and 4 ways on 4 ranks (ZeRO's partitions cut afresh from the universal form) trains steps 4-6
    as the row did."""
    row = runs["zero1"]
    checkpoint = row.output_dir / "checkpoints" / "step00000003"
    resumed = launch(
        CONFIG,
        {**overrides("zero1", sequence), "trainer.resume": str(checkpoint)},
        tmp_path / "resumed",
        nproc=ranks,
    )
    assert [record["step"] for record in resumed.records] == [4, 5, 6]
    assert max_loss_difference(resumed.losses, row.losses[3:]) <= TOLERANCE, (resumed.losses, row.losses[3:])
    assert ("resumed through a universal checkpoint" in resumed.stdout) == (sequence != 2)
    expected = row.exported_state_dict()
    for name, tensor in resumed.exported_state_dict().items():
        assert (tensor - expected[name]).abs().max() <= TOLERANCE, name
