"""Shared test set-up: GPU-marked tests skip where no CUDA device exists; nothing else skips."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory):
    """One token cache for the session, outside ~/.cache: launched ranks inherit the variable, so a
    corpus the suite tokenizes once is reused by every later test, as a user's launches reuse it."""
    import os

    from data.tokens.cache import CACHE_ENV

    path = tmp_path_factory.mktemp("token-cache")
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if previous is None:
        os.environ.pop(CACHE_ENV)
    else:
        os.environ[CACHE_ENV] = previous
