"""The typed sections (engine/config/sections.py) against the schema, field by field, and the
views a resolved config gives."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import load_config
from engine.config.schema import SCHEMA
from engine.config.sections import DataSection, ModelSection, ParallelSection, TrainerSection, typed_section
from engine.launch.hardware import detect_hardware

SECTIONS = {"data": DataSection, "trainer": TrainerSection, "parallel": ParallelSection}


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_each_section_has_exactly_the_schemas_keys(name: str):
    fields = {field.name for field in dataclasses.fields(SECTIONS[name])}
    assert fields == set(SCHEMA["properties"][name]["properties"])


def test_the_model_section_types_the_keys_every_family_has():
    common = {field.name for field in dataclasses.fields(ModelSection)} - {"fields"}
    for branch in SCHEMA["properties"]["model"]["allOf"]:
        assert common <= set(branch["then"]["properties"])


@pytest.mark.parametrize("config_path", ["configs/tiny_gpt.json", "configs/tiny_resnet.json", "configs/3d.json"])
def test_a_resolved_config_reads_as_typed_sections(config_path: str):
    config = load_config(config_path, [], world_size=8, hardware=detect_hardware(local_world_size=8))
    document = config.document
    assert config.trainer.max_steps == document["trainer"]["max_steps"]
    assert config.data.as_mapping() == document["data"]
    assert config.parallel.tensor_parallel_size == document["parallel"]["tensor_parallel_size"]
    assert config.model.family == document["model"]["family"]
    assert dict(config.model.fields) == document["model"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.trainer.max_steps = 1  # type: ignore[misc]


def test_a_section_that_drifts_from_its_dataclass_is_refused():
    config = load_config("configs/tiny_gpt.json", [], world_size=1, hardware=detect_hardware(local_world_size=1))
    with pytest.raises(ValueError, match="unknown \\['surprise'\\]"):
        typed_section(TrainerSection, {**config.document["trainer"], "surprise": 1})
