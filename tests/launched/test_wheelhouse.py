"""The offline install (issue 40): a wheelhouse built by scripts/wheelhouse.py for this Python and
platform installs the engine into a fresh virtual environment through `scripts/setup.sh
--wheelhouse` with pip's network off, and that environment validates a config and trains a step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import run_to_end, set_arguments

GPT = "configs/tiny_gpt.json"
# Any index pip tried would be this closed port on loopback, so a download attempt fails at once.
UNREACHABLE_INDEX = "http://127.0.0.1:9/"


@pytest.mark.launch
def test_a_wheelhouse_installs_and_trains_without_network(tmp_path: Path) -> None:
    wheelhouse = tmp_path / "wheelhouse"
    built = run_to_end([sys.executable, "scripts/wheelhouse.py", str(wheelhouse)])
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert f"install from it without network: scripts/setup.sh --wheelhouse {wheelhouse}" in built.stdout
    assert [wheel.name for wheel in wheelhouse.glob("deepspeed-*.whl")] == ["deepspeed-0.19.8-py3-none-any.whl"]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    offline = {
        **os.environ,
        "PYTHON": python,
        "PIP_NO_INDEX": "1",
        "PIP_INDEX_URL": UNREACHABLE_INDEX,
        "PIP_FIND_LINKS": "",
        # Nor this machine's pip configuration, whose local find-links hold a torch wheel.
        "PIP_CONFIG_FILE": os.devnull,
    }
    installed = run_to_end(["bash", "scripts/setup.sh", "--wheelhouse", str(wheelhouse)], env=offline)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert "setup: torch 2.13.0+cpu, deepspeed 0.19.8" in installed.stdout

    validated = run_to_end([python, "-m", "engine", "validate", GPT])
    assert validated.returncode == 0, validated.stderr[-3000:]
    assert "valid for 1 rank(s)" in validated.stdout

    output_dir = tmp_path / "run"
    sets = set_arguments({"trainer.max_steps": 1, "trainer.output_dir": output_dir})
    # Its own extensions folder: torch keys a built op by the include paths of the torch that built it,
    # so the venv's build of DeepSpeed's shm op in the shared folder would make the suite's rebuild it.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    trained = run_to_end([python, "engine/main.py", "--deepspeed_config", GPT, *sets], env=env)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1] and math.isfinite(records[0]["loss"])
