"""Fixtures shared by the streamed corpus's tests (tests/unit/test_streaming.py and
tests/launched/test_streaming_launched.py)."""

import datasets
import pytest


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """As the engine runs (engine/__init__.py): no hub requests, not even the download-count ping
    that `load_dataset` sends for a packaged builder, which stalls for seconds without a network."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
