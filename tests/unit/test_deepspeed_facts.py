"""The DeepSpeed facts the config reads from engine/config/deepspeed_facts.json are the ones
engine/config/deepspeed_schema.py reads from the installed DeepSpeed, and the config itself never
imports DeepSpeed."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.config.deepspeed_facts import FACTS_FILE, deepspeed_facts
from engine.config.deepspeed_schema import facts_text, read_deepspeed
from tests.support.launch import ROOT


def test_the_facts_file_says_what_the_installed_deepspeed_says():
    # On a mismatch rewrite it: python -m engine.config.deepspeed_schema
    assert FACTS_FILE.read_text() == facts_text()


def test_the_config_reads_the_facts_from_the_file_for_this_release():
    live = read_deepspeed()
    facts = deepspeed_facts()
    assert facts.version == live["version"]
    assert dict(facts.sections) == live["sections"]
    assert [alias.old for alias in facts.aliases] == [alias["old"] for alias in live["aliases"]]
    assert {".".join(path): message for path, message in facts.removed.items()} == {
        ".".join(removed["path"]): removed["message"] for removed in live["removed"]
    }


def test_loading_a_config_imports_neither_deepspeed_nor_datasets(tmp_path):
    # A fresh interpreter: this one has imported DeepSpeed above.
    child = (
        "import json, sys\n"
        "from engine.config import load_config\n"
        "from engine.launch.hardware import detect_hardware\n"
        "load_config('configs/zero2.json', [], world_size=1, hardware=detect_hardware(1))\n"
        f"json.dump(sorted(sys.modules), open({str(tmp_path / 'modules.json')!r}, 'w'))\n"
    )
    subprocess.run([sys.executable, "-c", child], cwd=ROOT, check=True)
    modules = {name.split(".")[0] for name in json.loads((tmp_path / "modules.json").read_text())}
    assert not modules & {"deepspeed", "datasets", "pydantic", "transformers"}
