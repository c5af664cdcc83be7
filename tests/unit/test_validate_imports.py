"""`python -m engine validate`, the pre-flight of every launch, imports what checking a config
needs and nothing a run needs: no datasets library, no transformers, no torch.distributed
checkpointing or tensors; DeepSpeed only for its check of the ops the run will build on this
machine, which --no-hardware-check skips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import ROOT

RUN_ONLY = {"datasets", "transformers", "peft", "torch.distributed.checkpoint", "torch.distributed.tensor"}


def validate_imports(tmp_path: Path, *arguments: str) -> set[str]:
    """The modules a fresh interpreter holds after `python -m engine validate ARGUMENTS` (exit 0)."""
    listing = tmp_path / "modules.json"
    child = (
        "import json, sys\n"
        "from engine.cli import main\n"
        f"code = main(['validate', *{list(arguments)!r}])\n"
        f"json.dump(sorted(sys.modules), open({str(listing)!r}, 'w'))\n"
        "sys.exit(code)\n"
    )
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True, capture_output=True)
    return set(json.loads(listing.read_text()))


@pytest.mark.parametrize("checks", ["with hardware checks", "--no-hardware-check"])
def test_validate_imports_nothing_only_a_run_needs(tmp_path: Path, checks: str):
    arguments = ["configs/zero2.json", *([checks] if checks.startswith("--") else [])]
    modules = validate_imports(tmp_path, *arguments)
    assert sorted(RUN_ONLY & modules) == []
    if checks == "--no-hardware-check":
        assert sorted(name for name in modules if name.split(".")[0] == "deepspeed") == []
