"""Tokenize a corpus into a prepared folder (data/tokens/files.py) in bounded memory and at the
tokenizer's full speed.

Bytes and characters are encoded over whole blocks in C (`np.frombuffer`, `bytes.translate`), never
character by character in Python. A Hugging Face tokenizer gets batches of texts through its own
batched call, which its Rust core spreads over every core. A .txt document longer than
HF_PIECE_CHARS is cut for it only after a newline that sits between two non-space characters: a
byte-level BPE pre-tokenizer (GPT-2's, Llama 3's) splits there anyway, so the ids equal those of the
whole document (tests/unit/test_token_cache.py checks it on tinyshakespeare), while a 2 GB file never
becomes one 2 GB string.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, Tokenizer
from data.tokens.corpus import Corpus, Document
from data.tokens.files import SplitWriter, smallest_dtype

HF_BATCH_CHARS = 1 << 20
"""Text handed to a Hugging Face tokenizer per batched call: enough to keep every core busy."""
HF_PIECE_CHARS = 1 << 16
"""The shortest piece a long .txt document is cut into for a Hugging Face tokenizer."""
HF_CARRY_CHARS = 1 << 26
"""Text without a safe cut is cut here regardless: memory stays bounded on a file with no newlines."""
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_MAX_CODE_POINT = 0x110000


def char_vocabulary(corpus: Corpus) -> CharTokenizer:
    """Every character of every split, sorted (CharTokenizer.from_text's vocabulary). An ASCII piece
    is checked for characters not yet seen with one `bytes.translate` (C, at memory speed); any other
    piece marks its code points in a table."""
    ascii_seen = b""
    seen = np.zeros(_MAX_CODE_POINT, dtype=bool)
    for split in corpus.splits.values():
        for document in split():
            for piece in document:
                if piece.isascii():
                    new = piece.encode("ascii").translate(None, ascii_seen)
                    if new:
                        counts = np.bincount(np.frombuffer(ascii_seen + new, dtype=np.uint8), minlength=128)
                        ascii_seen = bytes(np.flatnonzero(counts).astype(np.uint8))
                else:
                    seen[_code_points(piece)] = True
    seen[list(ascii_seen)] = True
    chars = [chr(code) for code in np.flatnonzero(seen)]
    if not chars:
        raise ValueError("data.path: the corpus holds no text to build a char vocabulary from")
    return CharTokenizer(chars)


def write_splits(
    corpus: Corpus, tokenizer: Tokenizer, staging: Path, announce: Callable[[str], None]
) -> dict[str, dict[str, int]]:
    """Tokenize every split into `staging`; returns each split's token and document counts."""
    dtype = smallest_dtype(tokenizer.vocab_size)
    encode = _encoder(tokenizer)
    counts = {}
    started, work_done = time.perf_counter(), 0
    for split, documents in corpus.splits.items():
        writer = SplitWriter(staging, split, dtype)
        with tqdm(
            total=corpus.work[split],
            unit=corpus.unit,
            unit_scale=True,
            desc=f"tokenizing {split}",
            file=sys.stderr,
            disable=None,  # a bar on a terminal; a launch's rank logs get the summary line alone
        ) as bar:
            try:
                batches = piece_batches(documents(), cut=isinstance(tokenizer, HFTokenizer))
                work_done += _write_split(batches, writer, encode, tokenizer.eos_id, bar, by_rows=corpus.unit == "rows")
            except BaseException:
                writer.abandon()
                raise
        counts[split] = writer.finish()
    seconds = time.perf_counter() - started
    tokens = sum(count["tokens"] for count in counts.values())
    read = f"{work_done / 1e6:,.1f} MB of text" if corpus.unit == "B" else f"{work_done:,} rows"
    rate = f", {work_done / 1e6 / seconds:,.0f} MB/s" if corpus.unit == "B" else ""
    speed = f"{tokens / seconds:,.0f} tokens/s{rate}"
    announce(f"data: tokenized {read} into {tokens:,} tokens in {seconds:.1f} s ({speed})")
    return counts


Encode = Callable[[list[str]], list[np.ndarray]]


def _write_split(
    batches: Iterator[PieceBatch], writer: SplitWriter, encode: Encode, eos: int | None, bar: tqdm, *, by_rows: bool
) -> int:
    """Encode and write `batches` in order; returns the work done (rows, or characters of text).

    Each batch is encoded on a second thread while this one cuts the next: a Hugging Face tokenizer's
    batched call leaves the GIL while its Rust threads work, so the cutting costs no time."""
    done = 0
    with ThreadPoolExecutor(max_workers=1) as encoder:
        pending: tuple[PieceBatch, Future] | None = None
        for batch in itertools.chain(batches, [None]):
            submitted = None if batch is None else (batch, encoder.submit(encode, batch.pieces))
            if pending is not None:
                written, encoded = pending
                first = writer.tokens == 0 and not writer.documents
                writer.write(*written.assemble(encoded.result(), eos, first=first))
                work = written.documents if by_rows else written.chars
                bar.update(work)
                rate = writer.tokens / max(bar.format_dict["elapsed"], 1e-9)
                bar.set_postfix_str(f"{rate:,.0f} tokens/s", refresh=False)
                done += work
            pending = submitted
    return done


class PieceBatch:
    """Consecutive pieces of text, each marked by whether it opens a document."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.opens: list[bool] = []
        self.chars = 0

    @property
    def documents(self) -> int:
        return sum(self.opens)

    def add(self, piece: str, opens: bool) -> None:
        self.pieces.append(piece)
        self.opens.append(opens)
        self.chars += len(piece)

    def assemble(self, encoded: list[np.ndarray], eos: int | None, *, first: bool) -> tuple[np.ndarray, list[int]]:
        """The batch's ids (`encoded`, piece by piece) with the end-of-text id before every document
        but the split's first, and where in them each document's own ids start."""
        parts, starts, length = [], [], 0
        for index, ids in enumerate(encoded):
            if self.opens[index]:
                if eos is not None and not (first and index == 0):
                    parts.append(np.array([eos]))
                    length += 1
                starts.append(length)
            parts.append(ids)
            length += len(ids)
        return np.concatenate(parts), starts


def piece_batches(documents: Iterator[Document], *, cut: bool) -> Iterator[PieceBatch]:
    """Pieces gathered into batches of about HF_BATCH_CHARS; batches may span documents. Public so
    that bench/data_preparation.py times a tokenizer alone on the very batches the engine encodes."""
    batch = PieceBatch()
    for document in documents:
        opens = True
        for piece in _pieces(document, cut=cut):
            batch.add(piece, opens)
            opens = False
            if batch.chars >= HF_BATCH_CHARS:
                yield batch
                batch = PieceBatch()
        if opens:  # a document with no text still counts, and still gets its separator
            batch.add("", True)
    if batch.pieces:
        yield batch


def _pieces(document: Document, *, cut: bool) -> Iterator[str]:
    """The document's pieces; for a Hugging Face tokenizer, re-cut at safe boundaries (see the module
    docstring). Text with no safe boundary in HF_CARRY_CHARS is cut there regardless, to keep memory
    bounded; only such a document's ids can then differ from a whole-document encode."""
    if not cut:
        yield from document
        return
    carry = ""
    for block in document:
        text = carry + block
        begin = 0
        for match in _SAFE_CUT.finditer(text):
            if match.start() - begin >= HF_PIECE_CHARS:
                yield text[begin : match.start()]
                begin = match.start()
        carry = text[begin:]
        if len(carry) > HF_CARRY_CHARS:
            yield carry
            carry = ""
    if carry:
        yield carry


def _encoder(tokenizer: Tokenizer) -> Encode:
    if isinstance(tokenizer, ByteTokenizer):
        return lambda texts: [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
    if isinstance(tokenizer, CharTokenizer):
        return _char_encoder(tokenizer)
    return lambda texts: [np.asarray(ids, dtype=np.int64) for ids in tokenizer.encode_batch(texts)]


def _char_encoder(tokenizer: CharTokenizer) -> Encode:
    """Ids by table lookup. ASCII characters sort before all others, so in any char vocabulary their
    ids are below 128: one 256-byte `bytes.translate` table encodes ASCII text in C, and an id of 128
    or more can only be the marker of a character missing from the vocabulary."""
    table = np.full(_MAX_CODE_POINT, -1, dtype=np.int64)
    table[[ord(char) for char in tokenizer.chars]] = np.arange(tokenizer.vocab_size)
    ascii_table = bytes(int(table[byte]) if table[byte] >= 0 else 255 for byte in range(256))

    def encode_chars(texts: list[str]) -> list[np.ndarray]:
        encoded = []
        for text in texts:
            if text.isascii():
                ids = np.frombuffer(text.encode("ascii").translate(ascii_table), dtype=np.uint8)
                unknown = len(ids) and ids.max() >= 128
            else:
                ids = table[_code_points(text)]
                unknown = len(ids) and ids.min() < 0
            if unknown:
                missing = next(char for char in text if table[ord(char)] < 0)
                raise ValueError(f"character {missing!r} is not in this char tokenizer's vocabulary")
            encoded.append(ids)
        return encoded

    return encode_chars


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
