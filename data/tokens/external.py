"""Token files that users already hold, opened as memory-mapped 1-D streams of ids.

Two layouts are read, the two that tokenized corpora in this field come in:

- A Megatron-LM / GPT-NeoX indexed dataset: `P.bin` holds every sequence's ids end to end and
  `P.idx` their dtype, lengths, byte offsets and document boundaries. It is read with
  megatron-core's own `IndexedDataset`, so this engine agrees with the tool that wrote it.
  `data.path` names the prefix `P`, or `P.bin` with `P.idx` beside it.
- nanoGPT's flat `.bin`: a headerless array of ids, uint16 as its prepare.py writes it (and this
  engine's prepared `train.bin`). A nanoGPT `meta.pkl` or this engine's `meta.json` beside it says
  which tokenizer wrote it; `meta.json` also gives the dtype.

The stream is the file's ids as they lie, documents running into each other: Megatron's
preprocessing appends an end-of-document id where asked (`--append-eod`) and nanoGPT's appends
GPT-2's end-of-text, so a separator is in the file or nowhere, as in Megatron's GPTDataset.

Every problem is a ValueError that starts with the config path it is about (`data.path[1]`,
`data.dtype`, `data.tokenizer`), raised before any process group exists.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from data.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, load_tokenizer
from data.tokens.cache import default_cache_dir
from data.tokens.files import FORMAT, META_FILE, read_meta, source_record

DTYPES = ("uint8", "uint16", "int32", "uint32", "int64")
"""What `data.dtype` may name (null: what the file records)."""
NANOGPT_DTYPE = np.dtype(np.uint16)
"""nanoGPT's prepare.py writes uint16 and records no dtype: the default for a flat .bin without meta.json."""
NANOGPT_META = "meta.pkl"
SCAN_BLOCK_BYTES = 64 << 20
"""The id scan reads this much at a time: memory stays flat, and np.max runs at memory speed."""
SCAN_CACHE_VERSION = 1
_MEGATRON_IMPORT_WARNING = "Transformer Engine and Apex are not installed"


def import_megatron(module: str) -> ModuleType:
    """A megatron-core module, imported on first use only: importing megatron.core takes seconds and
    warns four times that Transformer Engine and Apex are absent, which its dataset code never uses."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MEGATRON_IMPORT_WARNING)
        return importlib.import_module(module)


@dataclass(frozen=True)
class Vocabulary:
    """What a token file's ids stand for, and who said so (for messages)."""

    tokenizer: Tokenizer | None
    size: int | None
    origin: str

    @property
    def identity(self) -> str | None:
        """Equal for files written with the same tokenizer: its fingerprint, else the bare vocabulary size."""
        if self.tokenizer is not None:
            return self.tokenizer.fingerprint
        return None if self.size is None else f"{self.size} ids"

    def describe(self) -> str:
        if self.tokenizer is not None:
            return f"tokenizer {self.tokenizer.fingerprint} of {self.size} ids ({self.origin})"
        if self.size is not None:
            return f"a vocabulary of {self.size} ids and no tokenizer ({self.origin})"
        return f"no known tokenizer ({self.origin})"


@dataclass(frozen=True, eq=False)
class TokenFile:
    """One opened token file: `tokens` is a read-only memory map, so nothing is read until a window is."""

    where: str
    """The config path that named it: data.path, data.path[1], data.validation_path[0]."""
    path: Path
    """The file that holds the ids (a Megatron dataset's .bin)."""
    layout: str
    """"megatron" or "flat"."""
    tokens: np.ndarray
    vocabulary: Vocabulary

    @property
    def label(self) -> str:
        """How messages name it: the config path, then the file."""
        return f"{self.where}: '{self.path}'"


def open_token_file(
    path: str | Path, *, dtype: str | None = None, where: str = "data.path", tokenizer: Tokenizer | None = None
) -> TokenFile:
    """Open a Megatron indexed dataset (prefix, or .bin beside its .idx) or a flat nanoGPT .bin.

    `dtype` is `data.dtype`: None takes a Megatron .idx's own, a flat file's meta.json's, else
    uint16; a named one must agree with what the file records. `tokenizer` is the one `data.tokenizer`
    names (None where it is "char", the default, which defers to the file's metadata); it must agree
    with the metadata beside a flat file. Megatron files carry no tokenizer: theirs is `tokenizer`.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"data.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    layout, located = _locate(Path(path), where)
    if layout == "megatron":
        bin_path, tokens = _open_megatron(located, dtype, where)
        recorded = Vocabulary(None, None, "a Megatron .idx records none")
    else:
        meta = _engine_meta(located.parent)
        bin_path, tokens = located, _open_flat(located, meta, dtype, where)
        recorded = _recorded_vocabulary(located, meta, where, configured=tokenizer is not None)
    vocabulary = (
        recorded if tokenizer is None else _configured_vocabulary(tokenizer, recorded, f"{where}: '{bin_path}'")
    )
    return TokenFile(where=where, path=bin_path, layout=layout, tokens=tokens, vocabulary=vocabulary)


def _locate(path: Path, where: str) -> tuple[str, Path]:
    """("megatron", prefix) or ("flat", the .bin), or the one error that says what is there instead."""
    given = str(path)
    prefix = given[:-4] if path.suffix in (".bin", ".idx") else given
    # Megatron's own naming (get_bin_path, get_idx_path): the prefix plus the suffix, so 'a.b' stays whole.
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    if path.suffix == ".bin" and not idx_path.exists():
        if bin_path.is_file():
            return "flat", bin_path
        if bin_path.is_dir():
            raise ValueError(f"{where}: '{given}' is a directory, not a token file")
        raise ValueError(f"{where}: '{given}' does not exist")
    if bin_path.is_file() and idx_path.is_file():
        return "megatron", Path(prefix)
    if idx_path.is_file():
        raise ValueError(
            f"{where}: the Megatron index '{idx_path}' is there but its data file '{bin_path}' is missing; "
            "copy the .bin beside it"
        )
    if bin_path.is_file():
        raise ValueError(
            f"{where}: '{bin_path}' is there but its Megatron index '{idx_path}' is missing; copy the .idx beside "
            f"it, or give '{bin_path}' itself to read it as a flat (nanoGPT) token file"
        )
    if path.is_dir():
        inside = ", ".join(sorted(p.name for p in path.glob("*.bin"))[:4])
        hint = f" (it holds {inside}: give one of them)" if inside else ""
        raise ValueError(
            f"{where}: '{given}' is a directory; give a flat .bin or a Megatron prefix (P for P.bin and P.idx){hint}"
        )
    if path.is_file():
        raise ValueError(
            f"{where}: '{given}' is not a token file: a flat .bin or a Megatron prefix (P for P.bin and P.idx) is; "
            'raw text is read with data.type "text"'
        )
    raise ValueError(f"{where}: '{given}' does not exist, nor do '{bin_path}' and '{idx_path}'")


@dataclass(frozen=True)
class _MegatronIndex:
    dtype: np.dtype
    tokens: int
    misplaced: tuple[int, int, int] | None
    """(sequence, its byte offset, the offset that would follow the sequence before it), or None."""


def _read_megatron_index(prefix: Path, where: str) -> _MegatronIndex:
    """Read the .idx with megatron-core's IndexedDataset and keep plain numbers only: its arrays view
    memory maps that it closes when it goes."""
    indexed_dataset = import_megatron("megatron.core.datasets.indexed_dataset")
    idx_path = f"{prefix}.idx"
    # Built in two steps so that a failed __init__ leaves an object whose __del__ (which deletes both
    # readers) runs quietly, instead of printing an ignored AttributeError after this error.
    indexed = indexed_dataset.IndexedDataset.__new__(indexed_dataset.IndexedDataset)
    try:
        indexed.__init__(str(prefix), mmap=True)
    except (AssertionError, ValueError, OSError, struct.error) as error:
        for reader in ("bin_reader", "index"):
            if not hasattr(indexed, reader):
                setattr(indexed, reader, None)
        reason = str(error) or "its document indices do not cover its sequences"
        raise ValueError(f"{where}: '{idx_path}' is not a readable Megatron index ({reason})") from error
    dtype = np.dtype(indexed.index.dtype)
    lengths, pointers = indexed.sequence_lengths, indexed.index.sequence_pointers
    return _MegatronIndex(
        dtype=dtype,
        tokens=int(np.sum(lengths, dtype=np.int64)),
        misplaced=_first_misplaced_sequence(lengths, pointers, dtype.itemsize),
    )


def _first_misplaced_sequence(
    lengths: np.ndarray, pointers: np.ndarray, itemsize: int, block: int = 1 << 24
) -> tuple[int, int, int] | None:
    """The first sequence that does not start where the one before ends. The .bin is read as one
    stream, which is the sequences only if they lie end to end in index order, as
    IndexedDatasetBuilder writes them. In blocks, so a billion-sequence index needs no big temporaries."""
    start = 0
    for begin in range(0, len(lengths), block):
        sizes = lengths[begin : begin + block].astype(np.int64) * itemsize
        expected = start + np.concatenate(([0], np.cumsum(sizes[:-1])))
        actual = pointers[begin : begin + block]
        wrong = np.flatnonzero(actual != expected)
        if len(wrong):
            k = int(wrong[0])
            return begin + k, int(actual[k]), int(expected[k])
        start += int(sizes.sum())
    return None


def _open_megatron(prefix: Path, dtype: str | None, where: str) -> tuple[Path, np.ndarray]:
    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    index = _read_megatron_index(prefix, where)
    if not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"{where}: '{idx_path}' stores {index.dtype} values, not integer token ids")
    if dtype is not None and np.dtype(dtype) != index.dtype:
        raise ValueError(
            f"data.dtype: {dtype!r} disagrees with {where} '{idx_path}', whose index stores {index.dtype}; set "
            f'data.dtype to null (a Megatron index names its own) or "{index.dtype}"'
        )
    expected = index.tokens * index.dtype.itemsize
    actual = bin_path.stat().st_size
    if actual != expected:
        state = "truncated" if actual < expected else "longer than its index says"
        raise ValueError(
            f"{where}: '{bin_path}' holds {actual} bytes, but its index '{idx_path}' lists {index.tokens} "
            f"{index.dtype} tokens ({expected} bytes): {state}; copy the whole file, or rebuild the pair"
        )
    if index.misplaced is not None:
        sequence, offset, follows = index.misplaced
        raise ValueError(
            f"{where}: '{idx_path}' places sequence {sequence} at byte {offset}, not at {follows} where the one "
            "before it ends: its sequences are not stored end to end in order, so the .bin is not one token stream; "
            "rewrite it with megatron-core's IndexedDatasetBuilder (tools/preprocess_data.py)"
        )
    if index.tokens == 0:
        raise ValueError(f"{where}: '{bin_path}' holds no tokens")
    return bin_path, np.memmap(bin_path, dtype=index.dtype, mode="r", shape=(index.tokens,))


def _engine_meta(folder: Path) -> dict[str, Any] | None:
    """This engine's meta.json in `folder`, or None where there is none (or another tool's)."""
    if not (folder / META_FILE).is_file():
        return None
    try:
        meta = read_meta(folder)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _open_flat(bin_path: Path, meta: dict[str, Any] | None, dtype: str | None, where: str) -> np.ndarray:
    meta_dtype = np.dtype(meta["dtype"]) if meta and meta.get("dtype") else None
    if dtype is None:
        item = meta_dtype or NANOGPT_DTYPE
    else:
        item = np.dtype(dtype)
        if meta_dtype is not None and meta_dtype != item:
            raise ValueError(
                f"data.dtype: {dtype!r} disagrees with the {META_FILE} beside {where} '{bin_path}', which says "
                f'{meta_dtype}; set data.dtype to null or "{meta_dtype}"'
            )
    size = bin_path.stat().st_size
    if size == 0:
        raise ValueError(f"{where}: '{bin_path}' is empty")
    if size % item.itemsize:
        raise ValueError(
            f"{where}: '{bin_path}' holds {size} bytes, not a whole number of {item} tokens ({item.itemsize} bytes "
            f"each): truncated, or not {item}; set data.dtype to the type it was written in"
        )
    count = size // item.itemsize
    promised = ((meta or {}).get("splits") or {}).get(bin_path.stem, {}).get("tokens")
    if promised is not None and promised != count:
        raise ValueError(
            f"{where}: '{bin_path}' holds {count} tokens where the {META_FILE} beside it promises {promised}: "
            "truncated or replaced; copy the whole folder again"
        )
    return np.memmap(bin_path, dtype=item, mode="r", shape=(count,))


def _recorded_vocabulary(bin_path: Path, meta: dict[str, Any] | None, where: str, *, configured: bool) -> Vocabulary:
    """The vocabulary the metadata beside a flat .bin records. With `configured` (data.tokenizer names
    one), a tokenizer meta.json names by directory is not loaded: its recorded fingerprint is compared."""
    found = []
    if meta is not None:
        found.append(_meta_json_vocabulary(meta, f"{where}: '{bin_path}'", configured))
    if (bin_path.parent / NANOGPT_META).is_file():
        found.append(_meta_pkl_vocabulary(bin_path.parent / NANOGPT_META, f"{where}: '{bin_path}'", configured))
    if len(found) == 2 and found[0].identity != found[1].identity:
        raise ValueError(
            f"{where}: the metadata beside '{bin_path}' disagrees with itself: {found[0].describe()}, but "
            f"{found[1].describe()}; remove the one that does not belong"
        )
    return found[0] if found else Vocabulary(None, None, "no meta.json or meta.pkl beside it")


@dataclass(frozen=True)
class _RecordedFingerprint:
    """Stands in for a tokenizer that meta.json names by a directory not loaded (data.tokenizer overrides it)."""

    fingerprint: str
    vocab_size: int | None


def _meta_json_vocabulary(meta: dict[str, Any], label: str, configured: bool) -> Vocabulary:
    origin = f"its {META_FILE}"
    record = meta.get("tokenizer")
    size = meta.get("vocab_size")
    if not isinstance(record, dict):
        return Vocabulary(None, size, origin)
    spec, recorded = record.get("spec"), record.get("fingerprint")
    if spec == "char":
        if not isinstance(record.get("vocab"), list):
            raise ValueError(f"{label}: the {META_FILE} beside it names a char tokenizer but lists no vocab")
        tokenizer: Any = CharTokenizer(record["vocab"])
    elif spec == "byte":
        tokenizer = ByteTokenizer()
    elif configured:
        # data.tokenizer overrides a tokenizer named by directory: compare fingerprints, load nothing.
        if not recorded:
            return Vocabulary(None, size, origin)
        tokenizer = _RecordedFingerprint(recorded, size)
    elif spec and Path(spec).is_dir():
        tokenizer = load_tokenizer(spec, None)
    else:
        raise ValueError(
            f"{label}: the {META_FILE} beside it names the tokenizer directory {spec!r}, which is not here; set "
            "data.tokenizer to a copy of it"
        )
    if recorded and tokenizer.fingerprint != recorded:
        raise ValueError(
            f"{label}: the tokenizer at {spec!r} is not the one that wrote it (fingerprint {tokenizer.fingerprint}, "
            f"where its {META_FILE} records {recorded}); set data.tokenizer to the one that did"
        )
    return Vocabulary(tokenizer, getattr(tokenizer, "vocab_size", None) or size, origin)


def _meta_pkl_vocabulary(path: Path, label: str, configured: bool) -> Vocabulary:
    """nanoGPT's meta.pkl: `vocab_size`, and for character-level data `itos` (id -> char) and `stoi`."""
    origin = f"its {NANOGPT_META}"
    try:
        with open(path, "rb") as handle:
            # The user's own file beside their data, read as nanoGPT's train.py and sample.py read it.
            meta = pickle.load(handle)
    except Exception as error:  # a pickle can fail in any way its contents choose
        raise ValueError(f"{label}: the {NANOGPT_META} beside it cannot be read ({error})") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{label}: the {NANOGPT_META} beside it holds a {type(meta).__name__}, not nanoGPT's dict")
    size = meta.get("vocab_size")
    itos = meta.get("itos")
    if not itos:
        return Vocabulary(None, size, origin)
    chars = [itos.get(i) for i in range(len(itos))] if isinstance(itos, dict) else list(itos)
    if not all(isinstance(char, str) and len(char) == 1 for char in chars):
        if configured:
            return Vocabulary(None, size or len(itos), origin)
        raise ValueError(
            f"{label}: the {NANOGPT_META} beside it maps ids 0..{len(itos) - 1} to something other than single "
            "characters, so it is no char vocabulary; set data.tokenizer to the tokenizer that wrote the file"
        )
    tokenizer = CharTokenizer(chars)
    if size is not None and size != tokenizer.vocab_size:
        raise ValueError(
            f"{label}: the {NANOGPT_META} beside it says vocab_size {size} but its itos holds {tokenizer.vocab_size}"
        )
    return Vocabulary(tokenizer, tokenizer.vocab_size, origin)


def _configured_vocabulary(tokenizer: Tokenizer, recorded: Vocabulary, label: str) -> Vocabulary:
    """data.tokenizer's tokenizer, checked against what the file's metadata records."""
    if recorded.tokenizer is not None:
        agrees = recorded.tokenizer.fingerprint == tokenizer.fingerprint
    else:
        agrees = recorded.size is None or recorded.size == tokenizer.vocab_size
    if not agrees:
        raise ValueError(
            f"data.tokenizer: tokenizer {tokenizer.fingerprint} of {tokenizer.vocab_size} ids is not the one that "
            f'wrote {label}, which has {recorded.describe()}; leave data.tokenizer at "char" to use the file\'s '
            "own, or name the one that wrote it"
        )
    return Vocabulary(tokenizer, tokenizer.vocab_size, "data.tokenizer")


@dataclass(frozen=True)
class IdRange:
    lowest: int
    highest: int


def scan_token_ids(file: TokenFile, *, cache_dir: Path | None = None) -> IdRange:
    """The lowest and highest id in the file, scanned once per file version.

    A full scan reads the whole file (seconds for 20 GB), so the answer is kept as a small JSON under
    `<cache>/scans/`, named by a digest of the file's resolved path, size, modification time and
    dtype: a later launch reads only that, and an edited, replaced or touched file is scanned again.
    Ranks that start together may each scan once; they write the same answer, each by a rename.
    """
    record = {**source_record([file.path])[0], "dtype": str(file.tokens.dtype), "version": SCAN_CACHE_VERSION}
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]
    cached_path = (default_cache_dir() if cache_dir is None else Path(cache_dir)) / "scans" / f"{digest}.json"
    try:
        cached = json.loads(cached_path.read_text())
        if {k: cached.get(k) for k in record} == record:
            return IdRange(int(cached["lowest"]), int(cached["highest"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or damaged: scan again
    ids = _scan(file.tokens)
    try:
        cached_path.parent.mkdir(parents=True, exist_ok=True)
        staging = cached_path.with_name(f"{cached_path.name}.{os.getpid()}.partial")
        staging.write_text(json.dumps({**record, "tokens": len(file.tokens), **ids.__dict__}) + "\n")
        os.replace(staging, cached_path)
    except OSError:
        pass  # a read-only cache costs a rescan next launch, which is no reason to stop this one
    return ids


def _scan(tokens: np.ndarray) -> IdRange:
    block = max(1, SCAN_BLOCK_BYTES // tokens.itemsize)
    lowest, highest = None, None
    for start in range(0, len(tokens), block):
        part = tokens[start : start + block]
        low, high = int(part.min()), int(part.max())
        lowest = low if lowest is None else min(lowest, low)
        highest = high if highest is None else max(highest, high)
    if lowest is None or highest is None:
        raise ValueError("an empty token stream has no ids to scan")
    return IdRange(lowest, highest)


def check_ids_below(
    files: Sequence[TokenFile],
    vocab_size: int,
    *,
    vocabulary: str = "the model's vocabulary",
    remedy: str = 'raise model.vocab_size above it, or set it to "auto" where the data names its tokenizer',
    cache_dir: Path | None = None,
) -> None:
    """Refuse, before any process starts, a file holding an id the embedding has no row for (or a
    negative one): on a GPU that is a device-side assert mid-run, on a CPU an IndexError."""
    ranges = [scan_token_ids(file, cache_dir=cache_dir) for file in files]
    refuse_ids_outside(files, ranges, vocab_size, vocabulary=vocabulary, remedy=remedy)


def refuse_ids_outside(
    files: Sequence[TokenFile],
    ranges: Sequence[IdRange],
    vocab_size: int | None,
    *,
    vocabulary: str = "the model's vocabulary",
    remedy: str = "",
) -> None:
    """check_ids_below on ranges already scanned; `vocab_size` None refuses negative ids only."""
    for file, ids in zip(files, ranges, strict=True):
        if ids.lowest < 0:
            raise ValueError(
                f"{file.label} holds id {ids.lowest}; ids are never negative, so it is not {file.tokens.dtype} "
                "data (set data.dtype to the type it was written in) or it is damaged"
            )
        if vocab_size is not None and ids.highest >= vocab_size:
            raise ValueError(
                f"{file.label} holds id {ids.highest}, at or above {vocabulary} of {vocab_size}"
                + (f"; {remedy}" if remedy else "")
            )
