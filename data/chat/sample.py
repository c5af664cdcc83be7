"""The project's own chat sample: a few hundred conversations built from the embedded corpus
(data/corpus/default.txt), with no download. What `data.type: "chat"` reads where data.path is null,
as text reads the corpus itself.

Each sonnet gives conversations of four shapes: a user asks to continue a passage and the assistant
gives the next lines (every third with a system turn); a user asks for the opening, then "And
then?" (two assistant turns); a user asks how it ends (the couplet); and for every fifth sonnet a
lookup through a tool turn. Built by hand-written rules in a fixed order, so the file is the same on
every machine: `python -m data.chat.sample` writes it, and tests/unit/test_chat_data.py checks the
committed file against it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from data.corpus import CHAT_SAMPLE, DEFAULT_CORPUS

SYSTEM = "You are a reciter who knows Shakespeare's sonnets by heart."
_HEADING = re.compile(r"^[IVXLC]+$")


def sonnets(text: str) -> list[tuple[str, list[str]]]:
    """(numeral, lines) of each sonnet: the lines under a heading of Roman numerals, indent removed."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if _HEADING.match(line.strip()):
            found.append((line.strip(), []))
        elif found and line.strip():
            found[-1][1].append(line.strip())
    return [(numeral, lines) for numeral, lines in found if len(lines) >= 14]


def conversations(text: str) -> Iterator[dict[str, list[dict[str, str]]]]:
    """Every conversation of the sample, in order, as chat records."""
    for number, (numeral, lines) in enumerate(sonnets(text)):
        for start in (0, 4, 8):
            messages = [{"role": "system", "content": SYSTEM}] if start == 0 else []
            passage = "\n".join(lines[start : start + 2])
            messages += [
                {"role": "user", "content": f"Continue this passage from Sonnet {numeral}:\n{passage}"},
                {"role": "assistant", "content": "\n".join(lines[start + 2 : start + 4])},
            ]
            yield {"messages": messages}
        yield {
            "messages": [
                {"role": "user", "content": f"Recite the opening of Sonnet {numeral}."},
                {"role": "assistant", "content": "\n".join(lines[:2])},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "\n".join(lines[2:4])},
            ]
        }
        yield {
            "messages": [
                {"role": "user", "content": f"How does Sonnet {numeral} end?"},
                {"role": "assistant", "content": "\n".join(lines[12:14])},
            ]
        }
        if number % 5 == 0:
            yield {
                "messages": [
                    {"role": "user", "content": f'Which sonnet begins "{lines[0]}"?'},
                    {"role": "assistant", "content": "I will search the sonnets for that line."},
                    {"role": "tool", "content": json.dumps({"sonnet": numeral, "line": 1})},
                    {"role": "assistant", "content": f"It is Sonnet {numeral}, which goes on: {lines[1]}"},
                ]
            }


def render_sample() -> str:
    """The sample's JSONL text, one record a line."""
    records = conversations(DEFAULT_CORPUS.read_text(encoding="utf-8"))
    return "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)


if __name__ == "__main__":
    CHAT_SAMPLE.write_text(render_sample(), encoding="utf-8")
    print(f"wrote {CHAT_SAMPLE}")
