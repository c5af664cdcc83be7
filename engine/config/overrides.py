"""`--set dotted.path=value` overrides, typed by the schema so that `--set trainer.max_steps=50`
sets the integer 50 and `--set bf16.enabled=auto` the string "auto"."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from engine.config.errors import ConfigIssue
from engine.config.schema import SPELLINGS
from engine.config.validate import keys_at, schema_at, suggest


def _accepted_types(schema: dict) -> list[str]:
    if "anyOf" in schema:
        return [kind for option in schema["anyOf"] for kind in _accepted_types(option)]
    if "const" in schema:
        return [f"const:{schema['const']}"]
    if "enum" in schema:
        return ["string"]
    kind = schema.get("type", "string")
    return kind if isinstance(kind, list) else [kind]


def parse_value(text: str, schema: dict) -> Any:
    """The value `text` stands for under `schema`; ValueError if no accepted type fits."""
    kinds = _accepted_types(schema)
    for kind in kinds:
        if kind.startswith("const:") and text == kind[len("const:") :]:
            return text
        if kind == "null" and text == "null":
            return None
        if kind == "boolean" and text in ("true", "false"):
            return text == "true"
        if kind == "integer":
            whole = _whole(text)
            if whole is not None:
                return whole
        if kind == "number":
            number = _finite(text)
            if number is not None:
                return number
        if kind in ("array", "object"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                pass
    if "string" in kinds:
        return text
    names = [f'"{kind[len("const:") :]}"' if kind.startswith("const:") else kind for kind in kinds]
    raise ValueError(f"expected {' or '.join(names)}")


def _whole(text: str) -> int | None:
    """An integer written as one (1000) or as a whole number (1e3, 1000.0), as a JSON file may hold it."""
    try:
        return int(text)
    except ValueError:
        number = _finite(text)
        return int(number) if number is not None and number.is_integer() else None


def _finite(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def apply_overrides(document: dict, assignments: Iterable[str]) -> list[ConfigIssue]:
    """Apply each `path=value` to `document` in place; return the problems instead of raising."""
    issues = []
    for assignment in assignments:
        path_text, sep, value_text = assignment.partition("=")
        path = path_text.strip().split(".")
        if not sep or not all(path):
            issues.append(ConfigIssue(f"--set {assignment}", "expected dotted.path=value"))
            continue
        schema = schema_at(path, document)
        if schema is None:
            for depth in range(len(path)):
                if schema_at(path[: depth + 1], document) is None:
                    hint = suggest(path[depth], keys_at(path[:depth], document))
                    issues.append(ConfigIssue(path_text, f"unknown key {path[depth]!r} in --set{hint}"))
                    break
            continue
        try:
            value = parse_value(value_text, schema)
        except ValueError as error:
            issues.append(ConfigIssue(path_text, f"--set value {value_text!r}: {error}"))
            continue
        target = document
        for key in path[:-1]:
            target = target.setdefault(key, {})
        target[path[-1]] = value
        _drop_other_spellings(document, tuple(path))
    return issues


def _drop_other_spellings(document: dict, path: tuple[str, ...]) -> None:
    """A `--set` of a key that DeepSpeed spellings also set (parallel.tensor_parallel_size beside a
    file's tensor_parallel.autotp_size) replaces the file's value under every spelling: the value typed
    last wins, as with any override, where the file's two spellings would be refused as a
    disagreement. A DeepSpeed section left empty goes with them. `python -m engine plan`'s layout
    search sets the engine's keys so on any config."""
    for key in {spelling.key for spelling in SPELLINGS if path in (spelling.key, spelling.path)}:
        for other in [key, *(spelling.path for spelling in SPELLINGS if spelling.key == key)]:
            # A section and its key, or a top-level key (DeepSpeed's sequence_parallel_size) alone.
            section = document.get(other[0]) if len(other) > 1 else document
            if other == path or not isinstance(section, dict) or other[-1] not in section:
                continue
            del section[other[-1]]
            if not section and len(other) > 1 and other != key:
                del document[other[0]]
