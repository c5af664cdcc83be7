"""The model registry owns everything about a family: no code outside models/ branches on a family's
name, and every registered family's entry is complete enough to train, plan and report on."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from data import SAMPLES
from engine.config import load_config
from engine.config.schema import SCHEMA
from engine.launch.hardware import detect_hardware
from models import FAMILIES, ModelFamily

ROOT = Path(__file__).resolve().parents[2]
# Where a family may not be named: everything that reads the registry instead of being part of it.
SEARCHED = ("engine", "data", "bench")
_NAME = "|".join(re.escape(name) for name in FAMILIES)
_QUOTED = rf"""["']({_NAME})["']"""
BRANCHES = re.compile(
    "|".join(
        (
            rf"[!=]=\s*{_QUOTED}",  # family == "gpt"
            rf"{_QUOTED}\s*[!=]=",  # "gpt" == family
            rf"\b(not\s+)?in\s*[(\[{{][^)\]}}]*{_QUOTED}",  # family in ("gpt", ...)
            rf"\bcase\s+{_QUOTED}",  # match family: case "gpt"
            rf"\bfamily\s*=\s*{_QUOTED}",  # family="gpt" passed on
            rf"\bget_family\(\s*{_QUOTED}",  # one family looked up by name
            rf"\bFAMILIES\[\s*{_QUOTED}",
        )
    )
)


def test_no_code_outside_models_branches_on_a_family_name():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in SEARCHED
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if BRANCHES.search(line)
    ]
    assert not found, "ask the family's registry entry instead:\n" + "\n".join(found)


def test_the_branch_pattern_catches_the_usual_spellings():
    name = next(iter(FAMILIES))
    for line in (
        f'if config.model.family == "{name}":',
        f"if '{name}' != family.name:",
        f'is_it = family in ("{name}", "other")',
        f'build_datasets(data, family="{name}", seed=0)',
        f'get_family("{name}").presets',
        f'    case "{name}":',
    ):
        assert BRANCHES.search(line), line
    assert not BRANCHES.search(f'CONFIG = ROOT / "configs" / "{name}2_124m.json"')


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_field_of_an_entry_is_set(name: str):
    family = FAMILIES[name]
    assert family.name == name
    for field in dataclasses.fields(ModelFamily):
        value = getattr(family, field.name)
        # Only a field typed as optional (a family without a tensor-parallel form) may be None.
        assert value is not None or "None" in str(field.type), field.name
    for field in dataclasses.fields(family.pipeline):
        assert getattr(family.pipeline, field.name) is not None, field.name


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_an_entry_names_data_the_engine_has_and_a_schema_of_its_presets(name: str):
    family = FAMILIES[name]
    assert family.presets
    assert family.data_types, "a family must train on some data.type"
    assert set(family.data_types) <= set(SCHEMA["properties"]["data"]["properties"]["type"]["enum"])
    assert family.samples in SAMPLES
    assert family.throughput_key.endswith("_per_s")
    assert family.model_schema["preset"]["enum"] == list(family.presets)
    model = SCHEMA["properties"]["model"]
    assert model["properties"]["family"]["enum"] == list(FAMILIES)
    (branch,) = (b for b in model["allOf"] if b["if"]["properties"]["family"]["const"] == name)
    assert set(family.model_schema) <= set(branch["then"]["properties"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_smallest_preset_validates_and_costs_flops(name: str, tmp_path: Path):
    """The first preset (the smallest) on synthetic data, as `python -m engine validate` loads it."""
    family = FAMILIES[name]
    if "synthetic" not in family.data_types:
        pytest.skip(f"{name} trains on no synthetic data")
    document = {
        "model": {"family": name, "preset": next(iter(family.presets))},
        "data": {"type": "synthetic"},
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    config = load_config(path, [], world_size=1, hardware=detect_hardware(local_world_size=1))
    if family.uses_vocabulary:
        config = config.with_vocab_size(256)  # what the tokenizer would settle
    data = config.data.as_mapping()
    assert family.flops_per_item(family.architecture(config.model.fields), data) > 0
    assert family.items_per_sample(data) >= 1
