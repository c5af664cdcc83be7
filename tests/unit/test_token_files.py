"""Token files users already hold (`data.type: "tokens"`): Megatron indexed datasets written by
megatron-core's own IndexedDatasetBuilder, nanoGPT's flat .bin with its meta.pkl, blends whose
indices are compared with megatron-core's, the id-scan cache, and every bad input's message.
All files are tiny and written to tmp_path."""

import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from data.tokenizers import ByteTokenizer, CharTokenizer
from data.tokens.blend import BlendedTokens, load_token_datasets
from data.tokens.external import check_ids_below, open_token_file, scan_token_ids
from data.tokens.files import FORMAT

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 4


def megatron():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers, indexed_dataset
    return indexed_dataset, helpers


def write_megatron(prefix: Path, documents: list[list[list[int]]], dtype=np.uint16) -> Path:
    """A Megatron indexed dataset as tools/preprocess_data.py writes it: each document's sequences
    added one by one, then the document closed."""
    indexed_dataset, _ = megatron()
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(torch.tensor(sequence))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def random_documents(seed: int, count: int, high: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.integers(0, high, size=int(rng.integers(1, 12))).tolist() for _ in range(int(rng.integers(1, 4)))]
        for _ in range(count)
    ]


def flatten(documents: list[list[list[int]]]) -> np.ndarray:
    return np.array([token for document in documents for sequence in document for token in sequence])


def write_nanogpt(folder: Path, text: str) -> tuple[Path, Path, list[str]]:
    """nanoGPT's data/shakespeare_char/prepare.py: a sorted char vocabulary, a 90/10 split, uint16
    ids written with tofile, and meta.pkl holding vocab_size, itos and stoi."""
    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    train_ids = [stoi[c] for c in text[: int(n * 0.9)]]
    val_ids = [stoi[c] for c in text[int(n * 0.9) :]]
    np.array(train_ids, dtype=np.uint16).tofile(folder / "train.bin")
    np.array(val_ids, dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, handle)
    return folder / "train.bin", folder / "val.bin", chars


def write_engine_folder(folder: Path, ids: np.ndarray, dtype: str, tokenizer: dict, vocab_size: int) -> Path:
    """A flat train.bin with this engine's meta.json beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    ids.astype(dtype).tofile(folder / "train.bin")
    meta = {
        "format": FORMAT,
        "version": 1,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "tokenizer": tokenizer,
        "splits": {"train": {"tokens": len(ids), "documents": 1}},
    }
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "train.bin"


def windows(stream: np.ndarray, seq_len: int, stride: int) -> list[np.ndarray]:
    return [stream[s : s + seq_len + 1] for s in range(0, len(stream) - seq_len, stride)]


def sample_window(sample: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([sample["input_ids"], sample["labels"][-1:]]).numpy()


@pytest.fixture(autouse=True)
def scan_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSENGINE_DATA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# --- Megatron indexed datasets -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
@pytest.mark.parametrize("form", ["prefix", "bin"])
def test_megatron_file_reads_back_as_megatron_wrote_it(tmp_path, dtype, form):
    documents = random_documents(seed=0, count=20, high=1000)
    prefix = write_megatron(tmp_path / "corpus_text_document", documents, dtype)
    stream = flatten(documents)
    path = prefix if form == "prefix" else f"{prefix}.bin"

    opened = open_token_file(path, where="data.path")
    assert opened.layout == "megatron" and opened.tokens.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(opened.tokens, stream)
    indexed_dataset, _ = megatron()
    # Held in a name: its sequences view memory maps that the dataset closes when it is collected.
    read_back = indexed_dataset.IndexedDataset(str(prefix), mmap=True)
    np.testing.assert_array_equal(opened.tokens, np.concatenate([read_back[i] for i in range(len(read_back))]))
    del read_back

    seq_len, stride, fraction = 8, 3, 0.25
    data = load_token_datasets(path, seq_len=seq_len, stride=stride, validation_fraction=fraction)
    cut = int(len(stream) * (1 - fraction))
    expected_train, expected_validation = (
        windows(stream[:cut], seq_len, stride),
        windows(stream[cut:], seq_len, seq_len),
    )
    assert len(data.train) == len(expected_train) and len(data.validation) == len(expected_validation)
    for sample, expected in zip(data.train, expected_train, strict=True):
        np.testing.assert_array_equal(sample_window(sample), expected)
        assert sample["input_ids"].dtype == torch.long
    for sample, expected in zip(data.validation, expected_validation, strict=True):
        np.testing.assert_array_equal(sample_window(sample), expected)
    assert data.tokenizer is None and data.vocab_size is None and data.max_id == stream.max()


def test_megatron_file_takes_the_configured_tokenizer(tmp_path):
    prefix = write_megatron(tmp_path / "bytes", [[list(b"hello world, hello tokens")]], np.uint8)
    data = load_token_datasets(prefix, tokenizer="byte", seq_len=4, validation_fraction=0.2)
    assert isinstance(data.tokenizer, ByteTokenizer) and data.vocab_size == 256
    assert data.tokenizer.decode(data.train[0]["input_ids"].tolist()) == "hell"


# --- nanoGPT flat files and this engine's meta.json ----------------------------------------------------------


def test_nanogpt_files_read_back_with_their_char_tokenizer(tmp_path):
    train_bin, val_bin, chars = write_nanogpt(tmp_path / "shakespeare_char", TEXT)
    seq_len = 16
    data = load_token_datasets([str(train_bin)], validation_paths=str(val_bin), seq_len=seq_len)

    assert isinstance(data.tokenizer, CharTokenizer) and data.vocab_size == len(chars)
    assert data.tokenizer.fingerprint == CharTokenizer(chars).fingerprint
    assert data.files[0].tokens.dtype == np.uint16 and data.files[0].vocabulary.origin == "its meta.pkl"
    first = sample_window(data.train[0])
    assert data.tokenizer.decode(first) == TEXT[: seq_len + 1]
    val_text = TEXT[int(len(TEXT) * 0.9) :]
    assert data.tokenizer.decode(sample_window(data.validation[0])) == val_text[: seq_len + 1]
    assert len(data.validation) == (len(val_text) - 1) // seq_len
    assert len(data.train) == (int(len(TEXT) * 0.9) - 1) // seq_len  # all of train.bin trains


def test_engine_meta_json_gives_dtype_and_tokenizer(tmp_path):
    ids = np.frombuffer(TEXT.encode(), dtype=np.uint8)
    byte_bin = write_engine_folder(tmp_path / "bytes", ids, "uint8", {"spec": "byte", "fingerprint": "byte"}, 256)
    data = load_token_datasets(byte_bin, seq_len=8)
    assert data.files[0].tokens.dtype == np.uint8 and isinstance(data.tokenizer, ByteTokenizer)
    assert data.tokenizer.decode(sample_window(data.train[0])) == TEXT[:9]

    chars = sorted(set(TEXT))
    char = CharTokenizer(chars)
    char_ids = np.array(char.encode(TEXT))
    record = {"spec": "char", "fingerprint": char.fingerprint, "vocab": chars}
    char_bin = write_engine_folder(tmp_path / "chars", char_ids, "uint32", record, len(chars))
    data = load_token_datasets(char_bin, seq_len=8)
    assert data.files[0].tokens.dtype == np.uint32 and data.tokenizer.fingerprint == char.fingerprint


# --- blends ---------------------------------------------------------------------------------------------------


def test_blend_follows_megatron_blending_indices(tmp_path):
    seq_len = 4
    small = write_megatron(tmp_path / "small", [[list(range(100, 181))]])  # 81 tokens: 20 windows
    large = write_megatron(tmp_path / "large", [[list(range(1000, 1241))]])  # 241 tokens: 60 windows
    data = load_token_datasets([small, large], weights=[3, 1], seq_len=seq_len, validation_paths=[small, large])

    assert isinstance(data.train, BlendedTokens) and data.weights == [0.75, 0.25]
    sizes = [20, 60]
    assert data.train.source_sizes == sizes and len(data.train) == sum(sizes)
    _, helpers = megatron()
    dataset_index, sample_index = np.zeros(80, dtype=np.int16), np.zeros(80, dtype=np.int64)
    helpers.build_blending_indices(dataset_index, sample_index, [0.75, 0.25], 2, 80, False)
    np.testing.assert_array_equal(data.train.dataset_index, dataset_index)
    np.testing.assert_array_equal(data.train.dataset_sample_index, sample_index)

    counts = np.bincount(data.train.dataset_index, minlength=2)
    assert all(abs(count - 80 * weight) <= 1 for count, weight in zip(counts, [0.75, 0.25], strict=True))
    for prefix in (10, 33, 57):
        shares = np.bincount(data.train.dataset_index[:prefix], minlength=2)
        assert abs(shares[0] - prefix * 0.75) <= 1

    streams = [np.arange(100, 181), np.arange(1000, 1241)]
    for i in range(len(data.train)):
        source, window = int(dataset_index[i]), int(sample_index[i]) % sizes[int(dataset_index[i])]
        start = window * seq_len
        np.testing.assert_array_equal(sample_window(data.train[i]), streams[source][start : start + seq_len + 1])
    assert sample_index[dataset_index == 0].max() >= sizes[0]  # the small source, weighted high, wrapped

    # data.validation_path files: every window once, interleaved in proportion to their sizes.
    pairs = set(zip(data.validation.dataset_index.tolist(), data.validation.dataset_sample_index.tolist(), strict=True))
    assert len(data.validation) == 80 and pairs == {(s, w) for s in (0, 1) for w in range(sizes[s])}
    assert abs(np.bincount(data.validation.dataset_index[:20], minlength=2)[0] - 5) <= 1


def test_blend_holds_out_each_tail_and_blends_it_by_the_weights(tmp_path):
    documents = [random_documents(seed=seed, count=30, high=500) for seed in (1, 2)]
    prefixes = [write_megatron(tmp_path / f"part{i}", docs) for i, docs in enumerate(documents)]
    seq_len, stride = 5, 2
    data = load_token_datasets(prefixes, weights=[2.0, 1.0], seq_len=seq_len, stride=stride, validation_fraction=0.2)
    streams = [flatten(docs) for docs in documents]
    cuts = [int(len(stream) * 0.8) for stream in streams]
    heads = [windows(stream[:cut], seq_len, stride) for stream, cut in zip(streams, cuts, strict=True)]
    tails = [windows(stream[cut:], seq_len, seq_len) for stream, cut in zip(streams, cuts, strict=True)]

    for blend, expected in ((data.train, heads), (data.validation, tails)):
        assert isinstance(blend, BlendedTokens) and blend.weights == pytest.approx([2 / 3, 1 / 3])
        assert len(blend) == sum(len(source) for source in expected)
        counts = np.bincount(blend.dataset_index, minlength=2)
        assert abs(counts[0] - len(blend) * 2 / 3) <= 1
        for i in range(len(blend)):
            source = int(blend.dataset_index[i])
            window = int(blend.dataset_sample_index[i]) % len(expected[source])
            np.testing.assert_array_equal(sample_window(blend[i]), expected[source][window])


def test_blend_without_weights_takes_every_window_once(tmp_path):
    a = write_megatron(tmp_path / "a", [[list(range(41))]])  # 10 windows of 4
    b = write_megatron(tmp_path / "b", [[list(range(200, 221))]])  # 5 windows
    data = load_token_datasets([a, b], seq_len=4, validation_paths=[a])
    pairs = sorted(zip(data.train.dataset_index.tolist(), data.train.dataset_sample_index.tolist(), strict=True))
    assert pairs == [(0, w) for w in range(10)] + [(1, w) for w in range(5)]
    assert data.weights is None and data.train.weights == pytest.approx([2 / 3, 1 / 3])


# --- the id scan and its cache ----------------------------------------------------------------------------------


def test_id_scan_is_cached_until_the_file_changes(tmp_path, scan_cache, monkeypatch):
    from data.tokens import external

    scans = []
    real_scan = external._scan
    monkeypatch.setattr(external, "_scan", lambda tokens: scans.append(len(tokens)) or real_scan(tokens))
    monkeypatch.setattr(external, "SCAN_BLOCK_BYTES", 64)  # several blocks, as a large file has
    path = tmp_path / "ids.bin"
    np.array([5, 900, 3, 17] * 50, dtype=np.uint16).tofile(path)
    opened = open_token_file(path)

    assert scan_token_ids(opened) == external.IdRange(3, 900) and len(scans) == 1
    (cached,) = (scan_cache / "scans").glob("*.json")
    assert json.loads(cached.read_text())["highest"] == 900
    assert scan_token_ids(opened).highest == 900 and len(scans) == 1  # read from the JSON, not rescanned

    record = json.loads(cached.read_text())
    cached.write_text(json.dumps({**record, "highest": 12345}))
    assert scan_token_ids(opened).highest == 12345  # proof that the JSON is what answers

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched: a new version
    assert scan_token_ids(opened).highest == 900 and len(scans) == 2
    assert len(list((scan_cache / "scans").glob("*.json"))) == 2


# --- every bad input, named by its field ----------------------------------------------------------------------


def test_ids_at_or_above_the_vocabulary_are_refused(tmp_path):
    low = write_megatron(tmp_path / "low", [[list(range(50))]], np.int32)
    high = write_megatron(tmp_path / "high", [[[1, 2, 70000] + list(range(50))]], np.int32)
    data = load_token_datasets([low, high], seq_len=4)
    assert data.max_id == 70000
    check_ids_below(data.files, 70001)
    with pytest.raises(ValueError, match=r"^data\.path\[1\]: '.*high\.bin' holds id 70000, at or above the model's "):
        check_ids_below(data.files, 50304)

    negative = write_megatron(tmp_path / "negative", [[[1, -1] + list(range(50))]], np.int32)
    with pytest.raises(ValueError, match=r"^data\.path: '.*negative\.bin' holds id -1; ids are never negative"):
        load_token_datasets(negative, seq_len=4)


def test_ids_beyond_the_files_own_tokenizer_are_refused(tmp_path):
    train_bin, _, chars = write_nanogpt(tmp_path / "chars", TEXT)
    ids = np.fromfile(train_bin, dtype=np.uint16)
    ids[10] = len(chars) + 3
    ids.tofile(train_bin)
    with pytest.raises(ValueError, match=rf"^data\.path: .* holds id {len(chars) + 3}, at or above the vocabulary of "):
        load_token_datasets(train_bin, seq_len=8)


def test_truncated_files_are_refused(tmp_path):
    prefix = write_megatron(tmp_path / "cut", [[list(range(40))]], np.int32)
    with open(f"{prefix}.bin", "r+b") as handle:
        handle.truncate(150)
    with pytest.raises(ValueError, match=r"^data\.path: '.*cut\.bin' holds 150 bytes, but its index .* lists 40 "):
        load_token_datasets(prefix, seq_len=4)

    flat = tmp_path / "flat.bin"
    flat.write_bytes(b"\x01\x00\x02\x00\x03")
    with pytest.raises(ValueError, match=r"^data\.path\[0\]: '.*flat\.bin' holds 5 bytes, .* truncated, or not uint16"):
        load_token_datasets([flat], seq_len=1)

    short = write_engine_folder(tmp_path / "engine", np.arange(30), "uint16", {"spec": "byte"}, 256)
    with open(short, "r+b") as handle:
        handle.truncate(40)
    with pytest.raises(ValueError, match=r"^data\.path: .* holds 20 tokens where the meta\.json beside it promises 30"):
        load_token_datasets(short, seq_len=4)


def test_a_megatron_pair_missing_a_half_is_refused(tmp_path):
    prefix = write_megatron(tmp_path / "pair", [[list(range(40))]])
    Path(f"{prefix}.idx").rename(tmp_path / "elsewhere.idx")
    with pytest.raises(ValueError, match=r"^data\.path: .*index '.*pair\.idx' is missing"):
        load_token_datasets(prefix, seq_len=4)

    other = write_megatron(tmp_path / "other", [[list(range(40))]])
    Path(f"{other}.bin").unlink()
    with pytest.raises(ValueError, match=r"^data\.path\[0\]: .* data file '.*other\.bin' is missing"):
        load_token_datasets([f"{other}.bin"], seq_len=4)


def test_a_damaged_megatron_index_is_refused(tmp_path):
    prefix = write_megatron(tmp_path / "scrambled", [[list(range(10))], [list(range(10, 30))]])
    idx = Path(f"{prefix}.idx")
    header = 34  # magic, version, dtype code, sequence count, document count
    second_pointer = header + 2 * 4 + 8  # after two int32 lengths and the first int64 pointer
    raw = bytearray(idx.read_bytes())
    raw[second_pointer : second_pointer + 8] = np.array([4], dtype=np.int64).tobytes()  # at byte 4, not 20
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"^data\.path: .* places sequence 1 at byte 4, not at 20"):
        load_token_datasets(prefix, seq_len=4)

    idx.write_bytes(b"NOTANIDX" + bytes(raw[8:]))
    with pytest.raises(ValueError, match=r"^data\.path: '.*scrambled\.idx' is not a readable Megatron index"):
        load_token_datasets(prefix, seq_len=4)


def test_a_dtype_that_disagrees_with_the_files_record_is_refused(tmp_path):
    prefix = write_megatron(tmp_path / "wide", [[list(range(100))]], np.int32)
    with pytest.raises(ValueError, match=r"^data\.dtype: 'uint16' disagrees with data\.path .* stores int32"):
        load_token_datasets(prefix, dtype="uint16", seq_len=4)
    assert load_token_datasets(prefix, dtype="int32", seq_len=4).files[0].tokens.dtype == np.int32

    flat = write_engine_folder(tmp_path / "engine", np.arange(40), "uint32", {"spec": "byte"}, 256)
    with pytest.raises(ValueError, match=r"^data\.dtype: 'uint16' disagrees with the meta\.json .* says uint32"):
        load_token_datasets(flat, dtype="uint16", seq_len=4)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, 0.0], r"^data\.weights\[1\]: 0\.0 is not a positive number"),
        ([-2, 1], r"^data\.weights\[0\]: -2 is not a positive number"),
        ([1.0, float("nan")], r"^data\.weights\[1\]: nan is not a positive number"),
        ([1, 2, 3], r"^data\.weights: 3 weights for 2 data\.path entries"),
    ],
)
def test_bad_weights_are_refused(tmp_path, weights, message):
    a = write_megatron(tmp_path / "a", [[list(range(40))]])
    b = write_megatron(tmp_path / "b", [[list(range(40))]])
    with pytest.raises(ValueError, match=message):
        load_token_datasets([a, b], weights=weights, seq_len=4)


def test_files_of_different_tokenizers_are_not_blended(tmp_path):
    first, _, _ = write_nanogpt(tmp_path / "one", TEXT)
    second, _, _ = write_nanogpt(tmp_path / "two", "a completely different text, in lower case" * 5)
    with pytest.raises(
        ValueError, match=r"^data\.path\[1\]: '.*two/train\.bin' has tokenizer char:.* but data\.path\[0\]"
    ):
        load_token_datasets([first, second], seq_len=4)

    megatron_prefix = write_megatron(tmp_path / "plain", [[list(range(40))]])
    with pytest.raises(ValueError, match=r"^data\.path\[1\]: .* has no known tokenizer .* one tokenizer"):
        load_token_datasets([first, megatron_prefix], seq_len=4)

    with pytest.raises(
        ValueError, match=r"^data\.tokenizer: tokenizer byte of 256 ids is not the one that wrote data\.path"
    ):
        load_token_datasets(first, tokenizer="byte", seq_len=4)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "nowhere", r"^data\.path: '.*nowhere' does not exist"),
        (lambda d: d / "nowhere.bin", r"^data\.path: '.*nowhere\.bin' does not exist"),
        (lambda d: d, r"^data\.path: '.*' is a directory; give a flat \.bin or a Megatron prefix"),
        (lambda d: (d / "notes.txt").write_text("hi") and d / "notes.txt", r"^data\.path: .* is not a token file"),
        (lambda d: (d / "tiny.bin").write_bytes(b"\x01\x00\x02\x00") and d / "tiny.bin", r"make no training window"),
        (lambda d: (d / "empty.bin").write_bytes(b"") is not None and d / "empty.bin", r"^data\.path: .* is empty"),
    ],
)
def test_what_is_no_token_file_is_refused(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        load_token_datasets(make(tmp_path), seq_len=4)


def test_a_blend_entry_too_small_for_a_window_is_named(tmp_path):
    big = write_megatron(tmp_path / "big", [[list(range(100))]])
    small = write_megatron(tmp_path / "small", [[list(range(5))]])
    with pytest.raises(ValueError, match=r"^data\.path\[1\]: '.*small\.bin': its first 4 of 5 tokens .* training"):
        load_token_datasets([big, small], weights=[1, 1], seq_len=4)
    with pytest.raises(ValueError, match=r"^data\.path\[0\]: .* its last 10 of 100 tokens .* no validation window"):
        load_token_datasets([big], seq_len=10)


def test_metadata_without_a_loadable_tokenizer(tmp_path):
    # nanoGPT's meta.pkl with a vocab_size alone: the vocabulary is known, the tokenizer is not.
    folder = tmp_path / "sized"
    folder.mkdir()
    np.array([1, 2, 3, 40] * 30, dtype=np.uint16).tofile(folder / "train.bin")
    with open(folder / "meta.pkl", "wb") as handle:
        pickle.dump({"vocab_size": 50}, handle)
    data = load_token_datasets(folder / "train.bin", seq_len=4)
    assert data.tokenizer is None and data.vocab_size == 50 and data.max_id == 40
    with pytest.raises(ValueError, match=r"^data\.tokenizer: tokenizer byte of 256 ids is not the one .* of 50 ids"):
        load_token_datasets(folder / "train.bin", tokenizer="byte", seq_len=4)

    # meta.json naming a tokenizer directory that is not on this machine: refused unless data.tokenizer
    # names one, which is then checked against the recorded fingerprint without loading the missing one.
    record = {"spec": str(tmp_path / "gone"), "fingerprint": "hf:0123456789abcdef"}
    flat = write_engine_folder(tmp_path / "hf", np.arange(100), "uint16", record, 50257)
    with pytest.raises(ValueError, match=r"^data\.path: .* names the tokenizer directory .*gone.*, which is not here"):
        load_token_datasets(flat, seq_len=4)
    with pytest.raises(ValueError, match=r"^data\.tokenizer: tokenizer byte .* has tokenizer hf:0123456789abcdef"):
        load_token_datasets(flat, tokenizer="byte", seq_len=4)
