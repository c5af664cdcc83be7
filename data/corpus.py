"""The corpus shipped inside the package, so a first run needs no download and no data path."""

from pathlib import Path

DEFAULT_CORPUS: Path = Path(__file__).parent / "corpus" / "default.txt"
"""Shakespeare's sonnets I-LV (public domain), about 34 KB of plain text."""

CHAT_SAMPLE: Path = Path(__file__).parent / "corpus" / "chat_sample.jsonl"
"""The project's chat sample, built from DEFAULT_CORPUS by data/chat/sample.py: what data.type "chat"
reads where data.path is null."""
