"""A streamed corpus (data.streaming) trained on two launched ranks: a run resumed from a
checkpoint reads on from each rank's saved position, so it continues exactly. The streamed corpus
itself is tested in-process in tests/unit/test_streaming.py."""

import json
from pathlib import Path

import pytest
import torch

from engine.describe import describe_run
from engine.preflight import RunError
from tests.support.launch import launch, set_arguments
from tests.support.streaming import offline  # noqa: F401 (a fixture: pytest finds it by name)

# --- launched: a streamed corpus trains on two ranks and resumes exactly ----------------------------


@pytest.mark.launch
def test_a_streamed_run_resumed_from_a_checkpoint_continues_exactly(tmp_path: Path):
    """Two ranks stream their halves of the rows; a run resumed from the step-3 checkpoint reads on from
    each rank's saved position, so its losses and final weights are the uninterrupted run's."""
    rows = [{"text": f"{i}: " + "Whether 'tis nobler in the mind to suffer " * (1 + i % 5)} for i in range(60)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for shard in range(2):
        lines = (json.dumps(row) for row in rows[shard::2])
        (corpus / f"part{shard}.jsonl").write_text("\n".join(lines) + "\n")
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("To be, or not to be, that is the question. " * 30)
    run = {
        "data.streaming": True,
        "data.path": str(corpus),
        "data.validation_path": str(held_out),
        "data.tokenizer": "byte",
        "model.dropout": 0.1,
        "zero_optimization.stage": 1,
        "gradient_accumulation_steps": 2,
        "trainer.max_steps": 6,
        "trainer.save_interval": 3,
    }
    straight = launch("configs/tiny_gpt.json", run, tmp_path / "straight")
    checkpoint = tmp_path / "straight" / "checkpoints" / "step00000003"
    assert all((checkpoint / "data" / f"rank{rank}.pt").is_file() for rank in (0, 1))
    resumed = launch("configs/tiny_gpt.json", {**run, "trainer.resume": str(checkpoint)}, tmp_path / "resumed")
    assert [record["step"] for record in resumed.records] == [4, 5, 6]
    assert resumed.losses == straight.losses[3:]
    final, expected = resumed.exported_state_dict(), straight.exported_state_dict()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    one_rank = {**run, "trainer.resume": str(checkpoint), "trainer.output_dir": str(tmp_path / "one")}
    with pytest.raises(RunError, match="data.streaming: checkpoint .* saved by 2 data-parallel ranks"):
        describe_run("configs/tiny_gpt.json", [argument.removeprefix("--set=") for argument in set_arguments(one_rank)])
