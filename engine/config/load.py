"""From a JSON file (plus `--set` overrides) to an EngineConfig, or a ConfigError listing every
problem. Nothing here starts a process group or builds a model."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from engine.config.errors import ConfigError, ConfigIssue
from engine.config.overrides import apply_overrides
from engine.config.resolve import EngineConfig, resolve
from engine.config.rules import rule_issues
from engine.config.validate import canonical_spellings, fill_defaults, schema_issues
from engine.hardware import Hardware


def read_document(path: Path) -> dict:
    """The JSON object in `path`; ConfigError naming the file and the line on failure."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError([ConfigIssue(str(path), "file not found")]) from None
    except IsADirectoryError:
        raise ConfigError([ConfigIssue(str(path), "is a directory, not a JSON config file")]) from None
    except UnicodeDecodeError as error:
        problem = f"not UTF-8 text (byte {error.start}); JSON must be UTF-8"
        raise ConfigError([ConfigIssue(str(path), problem)]) from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            [ConfigIssue(str(path), f"invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}")]
        ) from None
    if not isinstance(document, dict):
        raise ConfigError([ConfigIssue(str(path), "the top level must be a JSON object")])
    return document


def check_document(document: dict, world_size: int, hardware: Hardware | None) -> dict:
    """The defaults-filled document, or ConfigError with every schema and rule problem."""
    document = canonical_spellings(document)
    issues = schema_issues(document)
    if issues:
        # Cross-field rules read typed values; they run once the schema is satisfied.
        raise ConfigError(issues)
    filled = fill_defaults(document)
    issues = rule_issues(filled, world_size, hardware)
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
) -> EngineConfig:
    """Read, override, validate and resolve a config for a run of `world_size` processes."""
    path = Path(path)
    document = read_document(path)
    issues = apply_overrides(document, overrides)
    if issues:
        raise ConfigError(issues, str(path))
    try:
        filled = check_document(document, world_size, hardware if check_hardware else None)
    except ConfigError as error:
        raise ConfigError(error.issues, str(path)) from None
    return resolve(filled, world_size, hardware, source=path)
