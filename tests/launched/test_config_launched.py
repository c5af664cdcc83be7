"""The config contract at the command line: `python -m engine validate` and a rank started by
engine/main.py refuse a bad config with its JSON path and exit 2 before anything starts, and accept
a shipped one; a DeepSpeed config with comments trains as DeepSpeed would read it. The in-process
checks are tests/unit/test_config.py and tests/unit/test_config_documents.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.compare import CLIPPED_WEIGHT_TOLERANCE, LOSS_TOLERANCE, assert_weights_match, max_loss_difference
from tests.support.config import COMMENTED_ZERO2_OFFLOAD, with_changes
from tests.support.launch import ROOT, launch
from tests.support.reference import reference_run


@pytest.mark.parametrize("world_size", ["0", "-2", "two"])
def test_a_world_size_below_one_is_refused_by_the_command(world_size: str):
    result = subprocess.run(
        [sys.executable, "-m", "engine", "validate", "configs/tiny_gpt.json", "--world-size", world_size],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert f"argument --world-size: expected a whole number >= 1, got '{world_size}'" in result.stderr


def test_validate_command_reports_every_problem_and_exits_nonzero(tmp_path: Path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps(with_changes(zero_optimisation={"stage": 2}, trainer__max_step=1)))
    result = subprocess.run(
        [sys.executable, "-m", "engine", "validate", str(config), "--world-size", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 2
    assert "(2 problems)" in result.stderr
    assert 'zero_optimisation: unknown key (did you mean "zero_optimization"?)' in result.stderr
    assert 'trainer.max_step: unknown key (did you mean "max_steps"?)' in result.stderr


def test_validate_command_accepts_a_shipped_config_for_eight_ranks():
    result = subprocess.run(
        [sys.executable, "-m", "engine", "validate", "configs/zero3_offload.json", "--world-size", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ZeRO-3" in result.stdout and "x 8 = 64" in result.stdout


def test_every_rank_prints_a_config_error(tmp_path: Path):
    # The launcher ends the other ranks as soon as one exits, so rank 1 must not leave the message to rank 0.
    rank_one = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    result = subprocess.run(
        [sys.executable, "engine/main.py", "--deepspeed_config", "configs/tiny_gpt.json"]
        + ["--set=trainer.max_steps=-1", f"--set=trainer.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **rank_one},
        timeout=120,
    )
    assert result.returncode == 2
    assert "trainer.max_steps" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "logs").exists()


@pytest.mark.launch
def test_a_commented_deepspeed_config_trains_as_one_process(tmp_path: Path):
    """DeepSpeed's ZeRO-2 offload config with its `#` and `//` comments and trailing comma, as its
    tutorial writes it, trains on 2 ranks under the deepspeed launcher as one process does. The same
    launch runs Adam without bias correction (DeepSpeedExamples' BERT configs), which DeepSpeed's CPU
    Adam steps here and the reference writes out."""
    config = tmp_path / "ds_config.json"
    config.write_text(COMMENTED_ZERO2_OFFLOAD)
    overrides = {
        "trainer.max_steps": 3,
        "trainer.log_interval": 1,
        "trainer.eval_batches": 1,
        "optimizer.params.bias_correction": False,
    }
    run = launch(str(config), overrides, tmp_path / "run", nproc=2)
    reference = reference_run(str(config), overrides, world_size=2)
    resolved = json.loads((run.output_dir / "resolved_config.json").read_text())["optimizer"]["params"]
    assert (resolved["bias_correction"], resolved["torch_adam"]) == (False, False)  # DeepSpeed's CPU Adam
    assert len(run.losses) == 3
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)
