"""The text path as it was before the token cache: every document read into memory through the
`datasets` builders and tokenized one by one. The cached, memory-mapped path must give exactly
these tokens (tests/unit/test_token_cache.py)."""

from collections.abc import Sequence
from pathlib import Path

import datasets
import numpy as np

from data.hf_local import load_local_dataset
from data.tokenizers import Tokenizer

BUILDER_BY_SUFFIX = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def read_documents(paths: Sequence[Path], text_field: str = "text") -> tuple[list[str], list[str] | None]:
    """(training documents, validation documents or None): a .txt file is one document, a row of
    .json/.jsonl/.parquet one document, a save_to_disk folder its train and validation splits."""
    if len(paths) == 1 and paths[0].is_dir():
        saved = datasets.load_from_disk(str(paths[0]))
        if isinstance(saved, datasets.Dataset):
            return list(saved[text_field]), None
        held_out = next((split for split in ("validation", "test") if split in saved), None)
        return list(saved["train"][text_field]), None if held_out is None else list(saved[held_out][text_field])
    builder = BUILDER_BY_SUFFIX[paths[0].suffix.lower()]
    options = {"sample_by": "document"} if builder == "text" else {}
    rows = load_local_dataset(builder, data_files=[str(p) for p in paths], split="train", **options)
    return list(rows["text" if builder == "text" else text_field]), None


def token_stream(documents: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """The documents' ids end to end, with the tokenizer's end-of-text id between documents."""
    ids: list[int] = []
    for i, document in enumerate(documents):
        if i > 0 and tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        ids.extend(tokenizer.encode(document))
    return np.array(ids, dtype=np.int64)
