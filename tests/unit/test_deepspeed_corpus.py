"""Real DeepSpeed configs written by other projects (tests/data/deepspeed_configs, each beside its
source repository and path) validated as a user would bring them: only `model`, `data` and `trainer`
added. Each has the verdict recorded in sources.json; an accepted one reaches DeepSpeed as written
and passes DeepSpeed's own parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from deepspeed.runtime.config import DeepSpeedConfig

from engine.config.errors import ConfigError
from engine.config.load import load_config
from engine.config.validate import canonical_spellings
from tests.unit.test_config import GPU

CORPUS = Path(__file__).parents[1] / "data" / "deepspeed_configs"
SOURCES = json.loads((CORPUS / "sources.json").read_text())
ENGINE_SECTIONS = {
    "model": {"family": "gpt", "preset": "tiny"},
    "data": {"type": "synthetic"},
    # One rank of a GPU node, left as configured (the single-rank route would turn ZeRO off).
    "trainer": {"max_steps": 4, "single_rank_fast_path": False},
}


def corpus_config(entry: dict, directory: Path) -> Path:
    """The corpus file with the engine's sections added, as a user would write it."""
    document = json.loads((CORPUS / entry["file"]).read_text())
    path = directory / entry["file"]
    path.write_text(
        json.dumps(
            {
                **document,
                **ENGINE_SECTIONS,
                "trainer": {**ENGINE_SECTIONS["trainer"], "output_dir": str(directory / "run")},
            }
        )
    )
    return path


def test_the_corpus_names_a_source_for_every_file():
    files = {path.name for path in CORPUS.glob("*.json")} - {"sources.json"}
    assert files == {entry["file"] for entry in SOURCES}
    assert len(SOURCES) >= 20
    for entry in SOURCES:
        assert entry["repo"].count("/") == 1 and entry["path"], entry
    accepted = [entry for entry in SOURCES if entry["engine_verdict"] == "accepted"]
    assert len(accepted) >= 14


@pytest.mark.parametrize("entry", SOURCES, ids=[entry["file"].removesuffix(".json") for entry in SOURCES])
def test_each_real_config_gets_its_verdict(entry: dict, tmp_path: Path):
    path = corpus_config(entry, tmp_path)
    verdict = entry["engine_verdict"]
    if verdict == "accepted":
        config = load_config(path, world_size=1, hardware=GPU)
        given = canonical_spellings(json.loads((CORPUS / entry["file"]).read_text()))
        _assert_reaches_deepspeed_unchanged(given, config.deepspeed_config(), [])
        DeepSpeedConfig(config.deepspeed_config())
        return
    with pytest.raises(ConfigError) as raised:
        load_config(path, world_size=1, hardware=GPU)
    problems = {str(issue).partition(": ")[0]: str(issue).partition(": ")[2] for issue in raised.value.issues}
    assert set(problems) == set(verdict["refused"]), problems
    for where, phrase in verdict["refused"].items():
        assert problems[where].startswith(phrase), (where, problems[where])


def _assert_reaches_deepspeed_unchanged(given: Any, passed: Any, path: list) -> None:
    """Every value the config wrote (not "auto") is the value DeepSpeed receives."""
    if isinstance(given, dict):
        for key, value in given.items():
            assert key in passed, [*path, key]
            _assert_reaches_deepspeed_unchanged(value, passed[key], [*path, key])
    elif given != "auto":
        assert given == passed, (path, given, passed)


def test_deprecated_spellings_are_read_as_the_current_key_with_one_line(tmp_path: Path):
    entry = next(
        entry for entry in SOURCES if entry["file"] == "transformers__tests.deepspeed.ds_config_zero3_bf16.json"
    )
    config = load_config(corpus_config(entry, tmp_path), world_size=1, hardware=GPU)
    assert config.notices == (
        "bfloat16 is deprecated in DeepSpeed; read as bf16",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save is deprecated in DeepSpeed; read as "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    )
    ds = config.deepspeed_config()
    assert "bfloat16" not in ds and ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True


def test_a_deprecated_flag_takes_the_value_deepspeed_converts_it_to(tmp_path: Path):
    entry = next(entry for entry in SOURCES if entry["file"] == "DeepSpeedExamples__training.cifar.ds_config.json")
    path = corpus_config(entry, tmp_path)
    config = load_config(path, world_size=1, hardware=GPU)
    notice = "zero_optimization.cpu_offload is deprecated in DeepSpeed; read as zero_optimization.offload_optimizer"
    assert config.notices == (notice,)
    assert config.deepspeed_config()["zero_optimization"]["offload_optimizer"]["device"] == "none"  # it was false
    document = json.loads(path.read_text())
    document["zero_optimization"].update(cpu_offload=True, stage=2)
    path.write_text(json.dumps(document))
    offloaded = load_config(path, world_size=1, hardware=GPU)
    assert offloaded.deepspeed_config()["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
