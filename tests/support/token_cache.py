"""Corpora and cache folders shared by the token cache's tests (tests/unit/test_token_cache.py and
tests/launched/test_token_cache_launched.py)."""

from pathlib import Path

from data.corpus import DEFAULT_CORPUS

SONNETS = DEFAULT_CORPUS.read_text(encoding="utf-8")
"""Real text that ships with the engine (tests never depend on ../shared)."""


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def cache_folders(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir())
