"""The runs several launched test files read (tests/support/shared_runs.py), trained once per session,
when a test first asks for one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.shared_runs import SHARED_RUNS, Trained, train_shared


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, hf_tokenizer_dir: Path) -> Callable[[str], Trained]:
    """`trained(name)`: the shared run `name` of SHARED_RUNS, launched the first time it is asked for."""
    runs: dict[str, Trained] = {}

    def get(name: str) -> Trained:
        if name not in runs:
            runs[name] = train_shared(SHARED_RUNS[name], tmp_path_factory.mktemp(name), hf_tokenizer_dir)
        return runs[name]

    return get
