"""The token cache: a text corpus tokenized once, memory-mapped by every later load, rebuilt when
its source, tokenizer or text field changes or its files are damaged, and built by one process
while others wait. The cached path must give exactly the tokens and batches of reading every
document into memory (tests/support/text_reference.py), which is what every parity test relies on."""

import fcntl
import json
import os
import shutil
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

from data.corpus import DEFAULT_CORPUS
from data.loader import make_train_loader
from data.sharding import LazyPermutation, epoch_permutation
from data.text import PackedTokens, load_text_dataset
from data.tokenizers import load_tokenizer
from data.tokens import encode
from data.tokens.cache import CacheWaitTimeout
from data.tokens.files import open_prepared
from engine.cli import main as cli_main
from tests.support.launch import ROOT
from tests.support.text_reference import read_documents, token_stream
from tests.support.token_cache import SONNETS, cache_folders, write

SAMPLE = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def reference_stream(paths: list[Path], tokenizer, text_field: str = "text") -> tuple[np.ndarray, np.ndarray | None]:
    train, validation = read_documents(paths, text_field)
    return token_stream(train, tokenizer), None if validation is None else token_stream(validation, tokenizer)


def corpora(tmp_path: Path) -> dict[str, tuple[list[Path], str]]:
    """Every kind of source, each with the text field it uses."""
    rows = [{"body": f"document {i}: {SAMPLE * (i + 1)}", "id": i} for i in range(5)]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    datasets.Dataset.from_dict({"text": [SAMPLE[::-1], SAMPLE * 3]}).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": [SAMPLE * 3, SAMPLE.upper() * 2]}),
            "validation": datasets.Dataset.from_dict({"text": ["Who's there? Nay, answer me: stand, unfold."]}),
        }
    ).save_to_disk(str(tmp_path / "saved"))
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(SAMPLE.replace("\n", "\r\n").encode() * 3 + "ünïcødé\r".encode())
    return {
        "default": ([DEFAULT_CORPUS], "text"),
        "two txt files": ([write(tmp_path / "1.txt", SAMPLE * 4), write(tmp_path / "2.txt", SAMPLE.upper())], "text"),
        "crlf and unicode": ([crlf], "text"),
        "jsonl field": ([tmp_path / "rows.jsonl"], "body"),
        "parquet": ([tmp_path / "rows.parquet"], "text"),
        "saved with validation": ([tmp_path / "saved"], "text"),
    }


@pytest.mark.parametrize("tokenizer", ["char", "byte", "hf"])
def test_cached_tokens_equal_reading_every_document_into_memory(tmp_path, tokenizer, hf_tokenizer_dir):
    spec = str(hf_tokenizer_dir) if tokenizer == "hf" else tokenizer
    for name, (paths, field) in corpora(tmp_path).items():
        loaded = load_text_dataset(paths, seq_len=8, tokenizer=spec, text_field=field, validation_fraction=0.25)
        if tokenizer == "char":
            train_docs, validation_docs = read_documents(paths, field)
            text = "".join(train_docs + (validation_docs or []))
            expected_tokenizer = load_tokenizer("char", training_text=text)
        else:
            expected_tokenizer = load_tokenizer(spec, training_text=None)
        assert loaded.tokenizer.fingerprint == expected_tokenizer.fingerprint, name
        train, validation = reference_stream(paths, expected_tokenizer, field)
        if validation is None:
            split = int(len(train) * 0.75)
            train, validation = train[:split], train[split:]
        assert np.array_equal(np.asarray(loaded.train.tokens, dtype=np.int64), train), name
        assert np.array_equal(np.asarray(loaded.validation.tokens, dtype=np.int64), validation), name


def test_memory_mapped_batches_equal_the_in_memory_path_on_every_rank(tmp_path):
    """What the parity and resume tests rely on: the same micro-batches, rank by rank, step by step."""
    loaded = load_text_dataset(None, seq_len=16, stride=5)
    assert isinstance(loaded.train.tokens, np.memmap)
    train, _ = reference_stream([DEFAULT_CORPUS], loaded.tokenizer)
    in_memory = PackedTokens(train[: int(len(train) * 0.9)], seq_len=16, stride=5)
    for dp_rank in range(2):
        options = dict(micro_batch_size=3, grad_accum=2, dp_rank=dp_rank, dp_size=2, seed=11, start_step=4)
        mapped_batches = make_train_loader(loaded.train, **options)
        memory_batches = make_train_loader(in_memory, **options)
        for _ in range(12):
            mapped, memory = next(mapped_batches), next(memory_batches)
            assert torch.equal(mapped["input_ids"], memory["input_ids"]) and torch.equal(
                mapped["labels"], memory["labels"]
            )


def test_a_large_text_file_is_encoded_in_pieces_that_give_the_whole_files_ids(monkeypatch, hf_tokenizer_dir):
    """A byte-level BPE splits after a newline between two non-space characters anyway, so cutting
    there gives the ids of the whole document (the module's claim, on a real corpus)."""
    tokenizer = load_tokenizer(str(hf_tokenizer_dir), training_text=None)
    text = (SONNETS * 6)[:200_000]
    monkeypatch.setattr(encode, "HF_PIECE_CHARS", 1000)
    pieces = list(encode._pieces(iter([text[:70_000], text[70_000:]]), cut=True))
    assert len(pieces) > 100 and "".join(pieces) == text
    assert sum(tokenizer.encode_batch(pieces), []) == tokenizer.encode(text)


def test_a_second_load_reads_the_cache_and_tokenizes_nothing(tmp_path, monkeypatch, token_cache):
    corpus = write(tmp_path / "a.txt", SAMPLE * 20)
    first = load_text_dataset(corpus, seq_len=8, cache_dir=tmp_path / "cache")
    monkeypatch.setattr(encode, "write_splits", lambda *args: pytest.fail("the cached corpus was tokenized again"))
    second = load_text_dataset(corpus, seq_len=8, cache_dir=tmp_path / "cache")
    assert np.array_equal(first.train.tokens, second.train.tokens)
    (folder,) = cache_folders(tmp_path / "cache")
    meta = open_prepared(folder).meta
    assert meta["sources"][0]["path"] == str(corpus.resolve()) and meta["sources"][0]["size"] == len(SAMPLE) * 20
    assert meta["splits"]["train"]["tokens"] == len(SAMPLE) * 20 and meta["dtype"] == "uint8"
    assert meta["tokenizer"]["vocab"] == first.tokenizer.chars


def test_a_touched_source_another_tokenizer_or_text_field_prepares_anew(tmp_path, hf_tokenizer_dir):
    cache = tmp_path / "cache"
    corpus = write(tmp_path / "a.txt", SAMPLE * 20)
    load_text_dataset(corpus, seq_len=8, cache_dir=cache)
    os.utime(corpus, ns=(time.time_ns(), time.time_ns() + 10**9))
    load_text_dataset(corpus, seq_len=8, cache_dir=cache)
    load_text_dataset(corpus, seq_len=8, tokenizer="byte", cache_dir=cache)
    load_text_dataset(corpus, seq_len=8, tokenizer=str(hf_tokenizer_dir), cache_dir=cache)
    assert len(cache_folders(cache)) == 4
    rows = write(tmp_path / "rows.jsonl", "\n".join(json.dumps({"a": SAMPLE, "b": SAMPLE[::-1] * 2}) for _ in range(3)))
    by_a = load_text_dataset(rows, seq_len=8, text_field="a", cache_dir=cache)
    by_b = load_text_dataset(rows, seq_len=8, text_field="b", cache_dir=cache)
    assert len(cache_folders(cache)) == 6 and len(by_a.train) != len(by_b.train)


@pytest.mark.parametrize("damage", ["truncated tokens", "missing meta.json", "wrong document count"])
def test_a_damaged_cache_is_rebuilt_never_trained_on(tmp_path, damage, capsys):
    cache = tmp_path / "cache"
    corpus = write(tmp_path / "a.txt", SAMPLE * 20)
    whole = np.array(load_text_dataset(corpus, seq_len=8, cache_dir=cache).train.tokens)
    (folder,) = cache_folders(cache)
    if damage == "truncated tokens":
        with open(folder / "train.bin", "r+b") as handle:
            handle.truncate(100)
    elif damage == "missing meta.json":
        (folder / "meta.json").unlink()
    else:
        np.save(folder / "train.docs.npy", np.array([0, 5], dtype=np.int64))
    capsys.readouterr()
    again = load_text_dataset(corpus, seq_len=8, cache_dir=cache)
    assert "tokenizing" in capsys.readouterr().out
    assert np.array_equal(again.train.tokens, whole)


def test_a_process_waits_for_the_one_building_and_gives_up_with_a_clear_message(tmp_path):
    cache = tmp_path / "cache"
    corpus = write(tmp_path / "a.txt", SAMPLE * 20)
    load_text_dataset(corpus, seq_len=8, cache_dir=cache)
    (folder,) = cache_folders(cache)
    shutil.rmtree(folder)
    # Hold the lock of the corpus, as a process building it on this node would.
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write("pid 4242 on node-a")
        lock.flush()
        with pytest.raises(CacheWaitTimeout, match=r"data.cache_timeout_s: waited 0.5 s for pid 4242 on node-a"):
            load_text_dataset(corpus, seq_len=8, cache_dir=cache, cache_timeout_s=0.5)
    assert len(load_text_dataset(corpus, seq_len=8, cache_dir=cache).train) > 0  # released: built at once


def test_prepare_data_tokenizes_the_configs_corpus_once(tmp_path, capsys):
    corpus = write(tmp_path / "a.txt", SAMPLE * 40)
    options = ["--set", f"data.path={corpus}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    assert cli_main(["prepare-data", str(ROOT / "configs" / "tiny_gpt.json"), *options]) == 0
    first = capsys.readouterr().out
    assert "data: tokenizing" in first and f"train {len(SAMPLE) * 40:,} tokens in 1 documents (uint8" in first
    assert cli_main(["prepare-data", str(ROOT / "configs" / "tiny_gpt.json"), *options]) == 0
    assert "data: tokenizing" not in capsys.readouterr().out
    assert cli_main(["prepare-data", str(ROOT / "configs" / "tiny_gpt.json"), "--set", "data.path=/nowhere.txt"]) == 2
    assert "data.path" in capsys.readouterr().err


def test_samples_beyond_the_in_memory_limit_are_ordered_by_a_lazy_bijection(monkeypatch):
    for size in (1025, 4096, 100_003):
        order = LazyPermutation(size, seed=3)[0:size].numpy()
        assert np.array_equal(np.sort(order), np.arange(size))
        assert not np.array_equal(order, np.arange(size))
    assert not torch.equal(LazyPermutation(5000, seed=1)[0:50], LazyPermutation(5000, seed=2)[0:50])
    monkeypatch.setattr("data.sharding.IN_MEMORY_ORDER_UP_TO", 100)
    assert isinstance(epoch_permutation(101, 0, seed=0), LazyPermutation)
    assert not torch.equal(epoch_permutation(1000, 0, seed=0)[0:1000], epoch_permutation(1000, 1, seed=0)[0:1000])
    # Two ranks with accumulation read exactly the global batches one process reads, resumed or not.
    dataset = PackedTokens(np.arange(3000), seq_len=2)
    single = make_train_loader(dataset, micro_batch_size=8, grad_accum=2, dp_rank=0, dp_size=1, seed=4)
    expected = [torch.cat([next(single)["input_ids"] for _ in range(2)]) for _ in range(200)]  # past one epoch
    ranks = [
        make_train_loader(dataset, micro_batch_size=4, grad_accum=2, dp_rank=r, dp_size=2, seed=4, start_step=150)
        for r in range(2)
    ]
    for step in range(150, 200):
        micro = [[next(ranks[r])["input_ids"] for r in range(2)] for _ in range(2)]
        assert torch.equal(torch.cat([micro[k][r] for k in range(2) for r in range(2)]), expected[step])


def test_the_char_encoder_refuses_a_character_outside_its_vocabulary_on_both_paths():
    from data.tokenizers import CharTokenizer

    tokenizer = CharTokenizer(sorted("abcé"))
    encoder = encode._encoder(tokenizer)
    assert [ids.tolist() for ids in encoder(["abc", "éa"])] == [[0, 1, 2], [3, 0]]
    for text, missing in (("abd", "d"), ("éz", "z")):  # the ASCII table and the code-point table
        with pytest.raises(ValueError, match=f"character '{missing}' is not in this char tokenizer's vocabulary"):
            encoder([text])
