"""Schema validation with messages a user can act on, and default filling.

jsonschema finds the errors; this module rewrites them into `<json path>: <what to do>`, with a
did-you-mean for unknown keys (DeepSpeed silently ignores `zero_optimisation`; we must not).
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from collections.abc import Iterator
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

from engine.config.deepspeed_facts import converted, deepspeed_facts
from engine.config.errors import ConfigIssue, json_path
from engine.config.schema import SCHEMA, SPELLINGS

_VALIDATOR = Draft202012Validator(SCHEMA)
_DEEPSPEED = deepspeed_facts()
# Keys refused with a reason of their own instead of "unknown key": DeepSpeed's removals, in its
# words, and what DeepSpeed reads but ignores.
_REASONS: dict[tuple, str] = {
    **{path: f"removed from DeepSpeed: {message}" for path, message in _DEEPSPEED.removed.items()},
    ("optimizer", "params", "max_grad_norm"): "DeepSpeed does not apply max_grad_norm as an optimizer parameter (it "
    "warns and trains unclipped); clip with the top-level gradient_clipping",
    **{
        (*alias.section, alias.old): f"an older spelling of {json_path([*alias.section, alias.new])}, which is also "
        "given; keep only that one"
        for alias in _DEEPSPEED.aliases
        if alias.new
    },
    ("pipeline", "stages"): "DeepSpeed's pipeline engine reads no stage count here (PipelineModule's num_stages sets "
    "it); set pipeline.pipeline_parallel_size or parallel.pipeline_parallel_size",
    ("pipeline", "partition"): "DeepSpeed's pipeline engine ignores it (PipelineModule's partition_method splits the "
    "layers); set parallel.pipeline_partition_method",
    ("pipeline", "seed_layers"): "DeepSpeed's pipeline engine ignores it (a PipelineModule argument); every rank "
    "builds the whole model from trainer.seed, so each stage starts from the single-process weights",
}
# Each engine key that a DeepSpeed spelling sets, in the order of SPELLINGS.
_SPELLED_KEYS = tuple(dict.fromkeys(spelling.key for spelling in SPELLINGS))


def suggest(word: str, choices: list[str]) -> str:
    """' (did you mean "x"?)' when a choice is close to `word`, else ''."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def describe(schema: dict) -> str:
    """A short phrase for what a schema accepts, e.g. 'an integer >= 1 or "auto"'."""
    if "anyOf" in schema:
        return " or ".join(describe(option) for option in schema["anyOf"])
    if "const" in schema:
        return f'"{schema["const"]}"'
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(choice) for choice in schema["enum"])
    kind = schema.get("type", "value")
    if isinstance(kind, list):
        return " or ".join(kind)
    words = {
        "integer": "an integer",
        "number": "a number",
        "boolean": "true or false",
        "string": "a string",
        "null": "null",
        "array": "a list",
        "object": "an object",
    }
    text = words.get(kind, f"a {kind}")
    if kind == "array" and "type" in schema.get("items", {}):
        count = schema.get("minItems")
        exactly = f" {count}" if count is not None and count == schema.get("maxItems") else ""
        text += f" of{exactly} {schema['items']['type']}s"
    bounds = [
        (">=", schema.get("minimum")),
        (">", schema.get("exclusiveMinimum")),
        ("<=", schema.get("maximum")),
        ("<", schema.get("exclusiveMaximum")),
    ]
    return text + "".join(f" {op} {value}" for op, value in bounds if value is not None)


def _issues_for(error: ValidationError) -> Iterator[ConfigIssue]:
    path = json_path(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        for key in sorted(set(error.instance) - set(allowed)):
            where = json_path([*error.absolute_path, key])
            reason = _REASONS.get((*error.absolute_path, key))
            yield ConfigIssue(
                where, reason or f"unknown key{suggest(key, allowed)}; allowed here: {', '.join(allowed)}"
            )
    elif error.validator == "required":
        missing = error.message.split("'")[1]
        yield ConfigIssue(json_path([*error.absolute_path, missing]), "is required")
    elif error.validator == "enum" and list(error.absolute_path) == ["optimizer", "type"]:
        yield ConfigIssue(path, _optimizer_problem(str(error.instance)))
    elif error.validator == "enum":
        hint = suggest(str(error.instance), [str(choice) for choice in error.validator_value])
        yield ConfigIssue(path, f"{error.instance!r} is not {describe(error.schema)}{hint}")
    else:
        yield ConfigIssue(path, f"expected {describe(error.schema)}, got {error.instance!r}")


def _optimizer_problem(name: str) -> str:
    """Why an optimizer.type is refused: one DeepSpeed builds that the engine does not, or one DeepSpeed
    does not know either (it would look the name up in torch.optim at run time)."""
    if name.lower() in _DEEPSPEED.optimizers:
        return (
            f"{name!r} is a DeepSpeed optimizer this engine does not run: the accelerate backend and the "
            "single-process reference build the optimizer from torch, so only Adam, AdamW and SGD mean the same "
            "on every backend; use one of them"
        )
    return (
        f"{name!r} is not an optimizer DeepSpeed {_DEEPSPEED.version} builds ({', '.join(_DEEPSPEED.optimizers)})"
        f"{suggest(name, ['Adam', 'AdamW', 'SGD'])}; use Adam, AdamW or SGD"
    )


def schema_issues(document: Any) -> list[ConfigIssue]:
    """Every schema violation in `document`, one issue per problem, and every engine key that
    `canonical_spellings` left beside a DeepSpeed spelling of it with another value."""
    return [
        *(issue for error in _VALIDATOR.iter_errors(document) for issue in _issues_for(error)),
        *_non_finite(document, []),
        *_spelling_conflicts(document),
    ]


def _non_finite(instance: Any, path: list) -> Iterator[ConfigIssue]:
    """NaN and infinity, which Python's JSON reader accepts and every bound in the schema lets
    through (a comparison with NaN is false)."""
    if isinstance(instance, float) and not math.isfinite(instance):
        yield ConfigIssue(json_path(path), f"{instance} is not a finite number")
    elif isinstance(instance, dict):
        for key, value in instance.items():
            yield from _non_finite(value, [*path, key])
    elif isinstance(instance, list):
        for index, value in enumerate(instance):
            yield from _non_finite(value, [*path, index])


def canonical_spellings(document: dict) -> dict:
    """A copy of `document` spelled as the schema spells it, as DeepSpeed reads it.

    DeepSpeed reads optimizer names in any case ("adamw" is its AdamW), and reads some keys under
    other names: deprecated aliases (`stage3_gather_fp16_weights_on_model_save`, top-level
    `bfloat16`) and its models' field names beside their documented spellings. Each is renamed to
    the current key, its value converted as DeepSpeed converts it; one given together with its
    current key is left for the schema to refuse. DeepSpeed's spellings of the engine's own features
    (`tensor_parallel.autotp_size`, `pipeline.pipeline_parallel_size`, the top-level
    `sequence_parallel_size`: schema.SPELLINGS) move to the engine's key and leave the DeepSpeed
    section, emptied sections with them; where they disagree
    with each other or with the engine's key, nothing moves, for `schema_issues` to refuse."""
    document = copy.deepcopy(document)
    optimizer = document.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("type"), str):
        names = SCHEMA["properties"]["optimizer"]["properties"]["type"]["enum"]
        optimizer["type"] = {name.lower(): name for name in names}.get(optimizer["type"].lower(), optimizer["type"])
    for alias in _DEEPSPEED.aliases:
        section = _section(document, alias.section)
        if section is None or alias.old not in section or (alias.new and alias.new in section):
            continue
        value = section.pop(alias.old)
        if alias.new:
            new_value = converted(alias, value)
            if new_value is not None:
                section[alias.new] = new_value
    for key in _SPELLED_KEYS:
        _read_spellings(document, key)
    return document


def _given(document: dict, key: tuple[str, str]) -> list[tuple[tuple[str, str], Any, Any]]:
    """Where `document` sets the engine key `key`: each DeepSpeed spelling of it, then the key itself,
    as (path, value written, value read)."""
    places = [(spelling.path, spelling.read) for spelling in SPELLINGS if spelling.key == key]
    given = []
    for path, read in [*places, (key, None)]:
        section = _section(document, path[:-1])
        if section is not None and path[-1] in section:
            value = section[path[-1]]
            given.append((path, value, read(value) if read else value))
    return given


def _read_spellings(document: dict, key: tuple[str, str]) -> None:
    """Move the DeepSpeed spellings of `key` in `document` to `key`, where they agree with it."""
    given = _given(document, key)
    spelled = [path for path, _, _ in given if path != key]
    if not spelled or any(read != given[0][2] for _, _, read in given):
        return
    target = _section(document, key[:-1], create=True)
    if target is None:  # not an object, which the schema refuses
        return
    for path in spelled:
        section = _section(document, path[:-1])
        del section[path[-1]]
        if not section and len(path) > 1:  # a DeepSpeed section the spelling emptied; never the root
            del _section(document, path[:-2])[path[-2]]
    target[key[-1]] = given[0][2]


def _spelling_conflicts(document: Any) -> Iterator[ConfigIssue]:
    """Engine keys set by more than one spelling, with different values: the user meant one of them."""
    if not isinstance(document, dict):
        return
    for key in _SPELLED_KEYS:
        given = _given(document, key)
        if all(read == given[0][2] for _, _, read in given):
            continue
        (path, value, _), *others = given
        feature = next(spelling.feature for spelling in SPELLINGS if spelling.key == key)
        listed = " and ".join(f"{json_path(list(other))} is {json.dumps(written)}" for other, written, _ in others)
        yield ConfigIssue(
            json_path(list(path)),
            f"{json.dumps(value)} here, but {listed}; {'both' if len(others) == 1 else 'all'} set {feature}, so keep "
            "one of them (or give them the same value)",
        )


def spelling_notices(document: dict) -> list[str]:
    """One line for each deprecated key in `document` that `canonical_spellings` renames or drops, and
    for each DeepSpeed spelling it reads as the engine's key."""
    notices = []
    for alias in _DEEPSPEED.aliases:
        section = _section(document, alias.section)
        if not alias.deprecated or section is None or alias.old not in section:
            continue
        old = json_path([*alias.section, alias.old])
        if alias.new:
            notices.append(f"{old} is deprecated in DeepSpeed; read as {json_path([*alias.section, alias.new])}")
        else:
            notices.append(f"{old} is deprecated in DeepSpeed, which ignores it; dropped")
    for spelling in SPELLINGS:
        section = _section(document, spelling.path[:-1])
        if section is not None and spelling.path[-1] in section:
            notices.append(
                f"{json_path(list(spelling.path))} is DeepSpeed's spelling of {spelling.feature}; read as "
                f"{json_path(list(spelling.key))}"
            )
    return notices


def _section(document: dict, path: tuple[str, ...], create: bool = False) -> dict | None:
    """The object at `path`, or None; `create` makes the missing ones on the way."""
    for key in path:
        if create and isinstance(document, dict):
            document = document.setdefault(key, {})
        else:
            document = document.get(key) if isinstance(document, dict) else None
    return document if isinstance(document, dict) else None


def fill_defaults(document: dict) -> dict:
    """A copy of a schema-valid document with every default written in.

    `if`/`then` branches apply when their condition holds, so family- and type-specific defaults
    (GPT's dropout, AdamW's betas) land only where they belong.
    """
    filled = copy.deepcopy(document)
    _fill(filled, SCHEMA)
    return filled


def _fill(instance: Any, schema: dict) -> None:
    if not isinstance(instance, dict):
        return
    for key, subschema in schema.get("properties", {}).items():
        if key not in instance and "default" in subschema:
            instance[key] = copy.deepcopy(subschema["default"])
        if key in instance:
            if isinstance(instance[key], float) and takes_integer(subschema):
                # JSON Schema counts 2.0 and 5e8 as integers; the code reading them needs an int.
                instance[key] = int(instance[key])
            _fill(instance[key], subschema)
    for branch in schema.get("allOf", []):
        if Draft202012Validator(branch["if"]).is_valid(instance):
            _fill(instance, branch["then"])


def takes_integer(schema: dict) -> bool:
    """Whether `schema` accepts integers (alone or beside "auto" or null)."""
    return schema.get("type") == "integer" or any(option.get("type") == "integer" for option in schema.get("anyOf", []))


def schema_at(path: list[str], document: dict) -> dict | None:
    """The schema of the key at `path`, following `if`/`then` branches that `document` selects
    (or, where the document does not decide, any branch that knows the key)."""
    schema: dict = SCHEMA
    instance: Any = document
    for key in path:
        chosen: list[dict] = []
        others: list[dict] = []
        for branch in schema.get("allOf", []):
            selected = isinstance(instance, dict) and Draft202012Validator(branch["if"]).is_valid(instance)
            (chosen if selected else others).append(branch["then"].get("properties", {}))
        candidates = [*chosen, *others, schema.get("properties", {})]
        found = next((props[key] for props in candidates if key in props), None)
        if found is None:
            return None
        schema = found
        instance = instance.get(key) if isinstance(instance, dict) else None
    return schema


def keys_at(path: list[str], document: dict) -> list[str]:
    """Keys allowed under `path` (for did-you-mean suggestions)."""
    schema = SCHEMA if not path else schema_at(path, document)
    if schema is None:
        return []
    keys = set(schema.get("properties", {}))
    for branch in schema.get("allOf", []):
        keys |= set(branch["then"].get("properties", {}))
    return sorted(keys)
