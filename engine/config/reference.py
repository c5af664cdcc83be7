"""The config reference (docs/config_reference.md), generated from the schema so the two
cannot drift apart; a test fails when the committed file is stale."""

from __future__ import annotations

import json
from collections.abc import Iterator

from engine.config.schema import ENGINE_SECTIONS, SCHEMA
from engine.config.validate import describe

_HEADER = """# Config reference

Generated from `engine/config/schema.py` by `python -m engine docs`; do not edit by hand.

One JSON file configures a run. DeepSpeed's keys sit at the top level as DeepSpeed documents
them; the engine's own settings live in `model`, `data`, `trainer` and `parallel`. Unknown keys
are errors. `"auto"`, where accepted, is resolved by the engine before the run (see each key);
`python -m engine validate CONFIG --print-resolved` shows every resolved value.
"""


def _rows(prefix: str, schema: dict, condition: str = "") -> Iterator[tuple[str, str, str, str]]:
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}.{key}" if prefix else key
        if sub.get("type") == "object" and ("properties" in sub or "allOf" in sub):
            yield (path, "object", "", sub.get("description", "") + condition)
            yield from _rows(path, sub, condition)
            continue
        if "object" in sub.get("type", ()) and "properties" in sub:
            # An optional section (model.lora): null, or an object of the keys listed after it.
            yield (path, describe(sub), json.dumps(sub.get("default")), sub.get("description", "") + condition)
            yield from _rows(path, sub, condition)
            continue
        default = json.dumps(sub["default"]) if "default" in sub else ""
        yield (path, describe(sub), default, sub.get("description", "") + condition)
    for branch in schema.get("allOf", []):
        ((field, want),) = ((k, v["const"]) for k, v in branch["if"]["properties"].items())
        parent = schema.get("properties", {})
        # A key the parent already lists appears again only where the branch narrows it (a family's
        # presets), with the parent's description; `params` differs by optimizer type throughout.
        then = {
            **branch["then"],
            "properties": {
                k: v if k not in parent or k == "params" else {**parent[k], **v}
                for k, v in branch["then"].get("properties", {}).items()
                if k not in parent or k == "params" or {**parent[k], **v} != parent[k]
            },
        }
        yield from _rows(prefix, then, f' *(when {field} is "{want}")*')


def render_reference() -> str:
    deepspeed = {"properties": {k: v for k, v in SCHEMA["properties"].items() if k not in ENGINE_SECTIONS}}
    sections = [("DeepSpeed keys", deepspeed)] + [
        (f"`{name}`", {"properties": {name: SCHEMA["properties"][name]}}) for name in ENGINE_SECTIONS
    ]
    lines = [_HEADER]
    for title, schema in sections:
        lines += [f"## {title}", "", "| key | accepts | default | meaning |", "|---|---|---|---|"]
        for path, accepts, default, meaning in _rows("", schema):
            cells = [f"`{path}`", accepts, f"`{default}`" if default else "", meaning]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        lines.append("")
    return "\n".join(lines)
