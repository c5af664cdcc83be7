"""Fixtures shared by the benchmark harness's tests (tests/unit/test_bench.py and
tests/launched/test_bench_launched.py)."""

from __future__ import annotations

import pytest

from bench import data
from data.corpus import DEFAULT_CORPUS


@pytest.fixture
def embedded_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The data benchmark's corpora made from the embedded sonnets: tests never depend on ../shared."""
    monkeypatch.setattr(data, "SOURCE", DEFAULT_CORPUS)
