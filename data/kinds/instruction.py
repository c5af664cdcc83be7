"""data.type "instruction": prompt/completion pairs, each rendered as a user turn and an assistant
turn with the chat template, then read as chat data is (data/kinds/chat.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from data.bundle import DataBundle
from data.chat.records import instruction_conversation
from data.kinds import chat as conversations
from data.kinds.chat import describe, prepare
from data.kinds.common import BuildRequest

GIVES = ("tokens",)
PATH_NEEDED = "prompt/completion records: .jsonl, .json or .parquet files, or a save_to_disk folder"
READS_TOKENIZER = True
MASKS_LABELS = True
SCHEMA = {
    **conversations.SCHEMA,
    "prompt_field": {
        "type": "string",
        "description": "instruction: the field holding each record's prompt (the user turn).",
        "default": "prompt",
    },
    "completion_field": {
        "type": "string",
        "description": "instruction: the field holding each record's completion (the assistant turn, the target).",
        "default": "completion",
    },
}
path_exists = conversations.path_exists
footprint = conversations.footprint


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    yield from conversations.config_issues(data)
    if data["prompt_field"] == data["completion_field"]:
        yield "data.completion_field", f"{data['completion_field']!r} is data.prompt_field too; name two fields"


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    return conversations.build_conversations(data, request, "instruction", _records(data))


def prepare_ahead(data: Mapping[str, Any]) -> str:
    return describe(*prepare(data, "instruction", _records(data)))


def _records(data: Mapping[str, Any]) -> conversations.ToConversation:
    return instruction_conversation(data["prompt_field"], data["completion_field"])
