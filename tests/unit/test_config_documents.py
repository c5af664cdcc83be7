"""A config file is read as DeepSpeed reads one (hjson: comments, trailing commas, unquoted keys)
and refused, as DeepSpeed refuses it, for a key given twice; plain JSON reads exactly as Python's
JSON reader reads it. The launched run of the commented config is in
tests/launched/test_config_launched.py."""

from __future__ import annotations

import json
from pathlib import Path

import hjson
import pytest
from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

from engine.config import ConfigError, load_config
from engine.config.load import read_document
from engine.launch.hardware import Hardware
from tests.support.config import COMMENTED_ZERO2_OFFLOAD
from tests.support.launch import ROOT

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
CORPUS = ROOT / "tests" / "data" / "deepspeed_configs"
# The shipped configs and the 34 real DeepSpeed configs of the corpus (sources.json lists them).
PLAIN_JSON = sorted([*(ROOT / "configs").glob("*.json"), *CORPUS.glob("*.json")])
PLAIN_JSON.remove(CORPUS / "sources.json")
# Commented as DeepSpeed's own configs may be (hjson): where their weights go, and their plans.
PLAIN_JSON.remove(ROOT / "configs" / "sft_llama3_8b_lora.json")
PLAIN_JSON.remove(ROOT / "configs" / "llama_1b_128k_sp.json")


def deepspeed_reads(path: Path) -> dict:
    """The dict `deepspeed.DeepSpeedConfig` builds from a config file path (deepspeed/runtime/config.py)."""
    with open(path) as handle:
        return hjson.load(handle, object_pairs_hook=dict_raise_error_on_duplicate_keys)


def test_a_commented_deepspeed_config_validates_as_deepspeed_reads_it(tmp_path: Path):
    path = tmp_path / "ds_config.json"
    path.write_text(COMMENTED_ZERO2_OFFLOAD)
    assert read_document(path) == deepspeed_reads(path)
    config = load_config(path, [], world_size=2, hardware=CPU)
    doc = config.document
    assert (doc["train_micro_batch_size_per_gpu"], doc["gradient_accumulation_steps"], config.dp_size) == (4, 1, 2)
    assert doc["zero_optimization"]["stage"] == 2
    assert doc["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert doc["zero_optimization"]["reduce_bucket_size"] == 500_000_000
    assert doc["optimizer"]["params"]["lr"] == 0.00015


def test_the_configuration_guides_commented_example_validates(tmp_path: Path):
    guide = (ROOT / "docs" / "configuration.md").read_text()
    path = tmp_path / "example.json"
    path.write_text(next(block for block in guide.split("```")[1::2] if "# ZeRO-2" in block))
    config = load_config(path, [], world_size=2, hardware=CPU)
    assert config.document["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_comments_change_nothing_the_json_reader_would_read(tmp_path: Path):
    """hjson makes `5e8` and `1.0` ints; the engine keeps JSON's floats, so the same config with and
    without comments is the same document, down to the types the schema checks."""
    commented = tmp_path / "commented.json"
    commented.write_text(COMMENTED_ZERO2_OFFLOAD)
    plain = deepspeed_reads(commented)
    plain["zero_optimization"]["reduce_bucket_size"] = 5e8
    assert json.dumps(read_document(commented)) == json.dumps(plain)


def test_unquoted_keys_and_a_bare_root_are_read(tmp_path: Path):
    path = tmp_path / "bare.hjson"
    path.write_text("# hjson's own form: no root braces, no quotes\ntrain_batch_size: 8\nbf16: {enabled: true}\n")
    assert read_document(path) == {"train_batch_size": 8, "bf16": {"enabled": True}}


def test_every_key_given_twice_is_refused_with_its_path(tmp_path: Path):
    path = tmp_path / "twice.json"
    path.write_text(
        "{\n"
        '  "trainer": {"max_steps": 3},\n'
        '  "zero_optimization": {"stage": 2, "stage": 3},  # DeepSpeed refuses this file\n'
        '  "trainer": {},\n'
        "}\n"
    )
    with pytest.raises(ValueError, match="Duplicate keys"):
        deepspeed_reads(path)
    with pytest.raises(ConfigError) as caught:
        load_config(path, world_size=1, hardware=CPU)
    assert caught.value.source == str(path)
    assert [str(issue) for issue in caught.value.issues] == [
        "trainer: given twice in one object, which DeepSpeed refuses; merge them",
        "zero_optimization.stage: given twice in one object, which DeepSpeed refuses; merge them",
    ]


def test_a_syntax_error_names_its_line_and_column(tmp_path: Path):
    path = tmp_path / "broken.json"
    path.write_text('{\n  # the batch\n  "train_batch_size" 8,\n}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path, world_size=1, hardware=CPU)
    assert [str(issue) for issue in caught.value.issues] == [
        f"{path}: invalid JSON (hjson) at line 3, column 22: Expecting ':' delimiter"
    ]


def test_an_unterminated_string_is_reported_without_hjsons_placeholder(tmp_path: Path):
    path = tmp_path / "open.json"
    path.write_text('{\n  "data": {"path": "corpus.txt},\n  "model": {}\n}\n')
    with pytest.raises(ConfigError, match=r"invalid JSON \(hjson\) at line 3, column 1: Invalid control character at$"):
        read_document(path)


@pytest.mark.parametrize("path", PLAIN_JSON, ids=[path.name for path in PLAIN_JSON])
def test_plain_json_reads_as_pythons_json_reader_reads_it(path: Path):
    assert json.dumps(read_document(path)) == json.dumps(json.loads(path.read_text()))


def test_json_numbers_keep_their_types(tmp_path: Path):
    numbers = '{"reduce_bucket_size": 5e8, "lr": 1e-3, "clip": 1.0, "steps": 8, "big": 1e400, "z": -0.0, "n": [2e3]}'
    path = tmp_path / "numbers.json"
    path.write_text(numbers)
    document = read_document(path)
    assert json.dumps(document) == json.dumps(json.loads(numbers))
    assert [type(value) for value in document.values()] == [float, float, float, int, float, float, list]
