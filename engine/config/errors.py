"""Config problems are collected, never raised one at a time: a user fixing a config wants
every mistake in one run, each pointing at the JSON path to edit."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ConfigIssue:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class ConfigError(Exception):
    """Every problem found in a config; the message lists them one per line."""

    def __init__(self, issues: Iterable[ConfigIssue], source: str | None = None):
        self.issues = sorted(set(issues))
        self.source = source
        where = f" in {source}" if source else ""
        count = len(self.issues)
        header = f"config error{where} ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([header, *(f"  {issue}" for issue in self.issues)]))


def json_path(parts: Iterable[object]) -> str:
    """Dotted path with [i] for list items; '$' is the document root."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "$"
