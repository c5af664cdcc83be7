"""What the config knows of the installed DeepSpeed, read without importing it.

engine/config/deepspeed_schema.py reads DeepSpeed's own pydantic models (section schemas, aliases,
removed keys, optimizer names), but importing DeepSpeed takes seconds, more than `python -m engine
validate` may. Its answer for one release is kept in deepspeed_facts.json beside this module and
read from there when that release is the one installed (its version taken from the package's
metadata, which imports nothing); another release, or a missing file, is read from DeepSpeed itself,
so the schema still follows the installed DeepSpeed. tests/unit/test_deepspeed_facts.py fails when
the file no longer says what deepspeed_schema reads; `python -m engine.config.deepspeed_schema`
rewrites it.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

FACTS_FILE = Path(__file__).with_name("deepspeed_facts.json")


@dataclass(frozen=True)
class Alias:
    """A key DeepSpeed reads as another: `new` is the current key beside it (None where DeepSpeed
    ignores the old one); `converts` where DeepSpeed turns the old value into the new one's."""

    section: tuple[str, ...]
    old: str
    new: str | None
    converts: bool = False
    deprecated: bool = True


@dataclass(frozen=True)
class DeepSpeedFacts:
    version: str
    sections: Mapping[str, dict]  # top-level key -> the JSON Schema of the model DeepSpeed parses it with
    timers: Mapping[str, dict]  # the same for the models under `timers`
    aliases: tuple[Alias, ...]
    removed: Mapping[tuple[str, ...], str]  # path of each key DeepSpeed refuses as removed -> its message
    optimizers: tuple[str, ...]  # the optimizer types DeepSpeed builds, lower case

    def section_schema(self, key: str) -> dict:
        """A copy of the schema of top-level `key`, for the config's schema to build on."""
        return copy.deepcopy(self.sections[key])

    def timer_schema(self, key: str) -> dict:
        return copy.deepcopy(self.timers[key])


def _installed_version() -> str | None:
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def deepspeed_facts() -> DeepSpeedFacts:
    """The facts of the installed DeepSpeed: from the file where it holds this release's."""
    record = json.loads(FACTS_FILE.read_text()) if FACTS_FILE.exists() else None
    if record is None or record["version"] != _installed_version():
        from engine.config.deepspeed_schema import read_deepspeed

        record = read_deepspeed()
    return DeepSpeedFacts(
        version=record["version"],
        sections=record["sections"],
        timers=record["timers"],
        aliases=tuple(
            Alias(tuple(alias["section"]), alias["old"], alias["new"], alias["converts"], alias["deprecated"])
            for alias in record["aliases"]
        ),
        removed={tuple(removed["path"]): removed["message"] for removed in record["removed"]},
        optimizers=tuple(record["optimizers"]),
    )


def converted(alias: Alias, value: Any) -> Any:
    """The value the new key takes, as DeepSpeed converts it: DeepSpeed's own function, imported
    only for a config that writes such a key."""
    if not alias.converts:
        return value
    from engine.config.deepspeed_schema import convert

    return convert(alias.section, alias.old, value)
