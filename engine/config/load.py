"""From a config file (plus `--set` overrides) to an EngineConfig, or a ConfigError listing every
problem. Nothing here starts a process group or builds a model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import hjson
from hjson.decoder import getNext, make_scanner, scantfnns

from engine.config.errors import ConfigError, ConfigIssue, json_path
from engine.config.overrides import apply_overrides
from engine.config.pretrained import apply_pretrained
from engine.config.resolve import EngineConfig, resolve, settle_plugin_values, settle_training_arguments
from engine.config.rules import rule_issues
from engine.config.support import backend_issues
from engine.config.validate import canonical_spellings, fill_defaults, schema_issues, spelling_notices
from engine.launch.hardware import Hardware


class _Object(dict):
    """An object that remembers the keys its text gave more than once: hjson, like Python's JSON
    reader, keeps the last and drops the first without a word, where DeepSpeed's hook refuses them."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        repeated: set[str] = set()
        for key, _ in pairs:
            (repeated if key in seen else seen).add(key)
        self.repeated = sorted(repeated)


def _repeated_keys(value: Any, path: list) -> Iterator[ConfigIssue]:
    if isinstance(value, _Object):
        for key in value.repeated:
            problem = "given twice in one object, which DeepSpeed refuses; merge them"
            yield ConfigIssue(json_path([*path, key]), problem)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield from _repeated_keys(item, [*path, key])


def _unquoted_value(context: hjson.HjsonDecoder, text: str, index: int) -> tuple[Any, int]:
    """hjson's reading of an unquoted value, with the number types JSON's reader gives: hjson makes a
    whole number written with a fraction or exponent an int (`1.0`, `5e8`), and the schema and the
    resolved config should not tell a commented config from the same one in plain JSON."""
    value, end = scantfnns(context, text, index)
    if type(value) in (int, Decimal):
        written = text[getNext(text, index)[1] : end]
        if any(mark in written for mark in ".eE"):
            value = float(written)
    return value, end


class _DeepSpeedReader(hjson.HjsonDecoder):
    """hjson, as DeepSpeed reads a config file (`deepspeed/runtime/config.py`), with JSON's number
    types. Floats are parsed as Decimal first: hjson compares each float with its int, which raises
    OverflowError on one beyond a float's range (`1e400`, JSON's inf)."""

    def __init__(self, object_pairs_hook: type[dict]) -> None:
        super().__init__(parse_float=Decimal, object_pairs_hook=object_pairs_hook)
        self.parse_tfnns = _unquoted_value
        self.scan_once, self.scan_object_once = make_scanner(self)


def read_document(path: Path) -> dict:
    """The object in `path`, read as DeepSpeed reads a config (hjson: JSON plus comments, trailing
    commas and unquoted keys) and refusing, as DeepSpeed does, a key given twice; ConfigError naming
    the file and the line on failure, or every key given twice."""
    try:
        text = path.read_text(encoding="utf-8")
        document = _DeepSpeedReader(_Object).decode(text)
    except FileNotFoundError:
        raise ConfigError([ConfigIssue(str(path), "file not found")]) from None
    except IsADirectoryError:
        raise ConfigError([ConfigIssue(str(path), "is a directory, not a JSON config file")]) from None
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text (byte {error.start}); JSON must be UTF-8"
        raise ConfigError([ConfigIssue(str(path), problem)]) from None
    except hjson.HjsonDecodeError as error:
        # hjson leaves "%r" in "Invalid control character %r at" to name the character one past the culprit.
        message = error.msg.replace(" %r", "")
        problem = f"invalid JSON (hjson) at line {error.lineno}, column {error.colno}: {message}"
        raise ConfigError([ConfigIssue(str(path), problem)]) from None
    if not isinstance(document, dict):
        raise ConfigError([ConfigIssue(str(path), "the top level must be a JSON object")])
    repeated = list(_repeated_keys(document, []))
    if repeated:
        raise ConfigError(repeated, str(path))
    return _DeepSpeedReader(dict).decode(text)  # plain dicts, now that no key is lost


def check_document(
    document: dict, world_size: int, hardware: Hardware | None, pretrained_required: bool = True
) -> dict:
    """The defaults-filled document, with what its `model.init_from` directory decides, or
    ConfigError with every schema and rule problem. `pretrained_required` False: a `model.init_from`
    directory that is not there gives way to a written `model.preset` (`plan` before the download)."""
    document = canonical_spellings(document)
    issues = schema_issues(document)
    if issues:
        # Cross-field rules read typed values; they run once the schema is satisfied.
        raise ConfigError(issues)
    # Before any default or preset is filled in: what the user wrote must be told from what they did not.
    document = apply_pretrained(document, absent_ok=not pretrained_required)
    filled = settle_plugin_values(settle_training_arguments(fill_defaults(document)))
    issues = [*rule_issues(filled, world_size, hardware), *backend_issues(document, filled)]
    if issues:
        raise ConfigError(issues)
    return filled


def load_config(
    path: str | Path,
    overrides: Iterable[str] = (),
    *,
    world_size: int,
    hardware: Hardware,
    check_hardware: bool = True,
    pretrained_required: bool = True,
) -> EngineConfig:
    """Read, override, validate and resolve a config for a run of `world_size` processes."""
    path = Path(path)
    document = read_document(path)
    issues = apply_overrides(document, overrides)
    if issues:
        raise ConfigError(issues, str(path))
    try:
        filled = check_document(document, world_size, hardware if check_hardware else None, pretrained_required)
    except ConfigError as error:
        raise ConfigError(error.issues, str(path)) from None
    config = resolve(filled, world_size, hardware, source=path)
    return config.with_notices(tuple(spelling_notices(document)))
