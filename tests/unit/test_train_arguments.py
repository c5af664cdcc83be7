"""How `engine/main.py` takes its config: DeepSpeed's `--deepspeed_config CONFIG`, HF Trainer's
`--deepspeed CONFIG`, and DeepSpeed scripts' bare `--deepspeed` flag beside either."""

from __future__ import annotations

import pytest

from engine.cli import train_arguments


@pytest.mark.parametrize(
    "argv",
    [
        ["--deepspeed_config", "c.json"],
        ["--deepspeed", "c.json"],
        ["--deepspeed", "--deepspeed_config", "c.json"],
        ["--deepspeed_config", "c.json", "--deepspeed"],
        ["--local_rank=1", "--deepspeed", "c.json", "--deepspeed_config", "c.json"],
        ["--deepspeed", "--deepspeed_config=c.json"],
        ["--deepspeed=c.json"],
    ],
)
def test_the_config_is_taken_as_deepspeed_and_hf_spell_it(argv: list[str]):
    args = train_arguments([*argv, "--set", "trainer.max_steps=3"])
    assert args.config == "c.json" and args.overrides == ["trainer.max_steps=3"]


@pytest.mark.parametrize(
    "argv",
    [["--local_rank=1"], ["--local_rank", "1"], ["--local-rank=1"], ["--local-rank", "1"]],
    ids=["deepspeed", "spaced", "torch-distributed-launch", "hyphen-spaced"],
)
def test_the_local_rank_is_taken_as_every_launcher_spells_it(argv: list[str]):
    """deepspeed's launch.py passes --local_rank=N, torch.distributed.launch --local-rank=N."""
    args = train_arguments([*argv, "--deepspeed", "--deepspeed_config", "c.json"])
    assert args.local_rank == 1 and args.config == "c.json"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--deepspeed", "a.json", "--deepspeed_config", "b.json"], "--deepspeed names a.json and --deepspeed_config"),
        (["--deepspeed"], "no config: give it as --deepspeed_config CONFIG (or HF's --deepspeed CONFIG)"),
        ([], "no config"),
    ],
)
def test_a_missing_or_doubled_config_is_one_usage_error(argv: list[str], message: str, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exited:
        train_arguments(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err
