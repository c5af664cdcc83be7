"""Tests of the streamed text corpus (data/streaming.py): its windows equal those cut by hand from
the rank's token stream, ranks are disjoint, and a saved position resumes to exactly the
micro-batches an uninterrupted run yields, mid-document, at a file boundary and after an epoch
wrap. Every corpus is a few tiny files in tmp_path."""

import io
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import datasets
import pytest
import torch

from data.streaming import StreamedWindows, stream_micro_batches
from data.tokenizers import ByteTokenizer, HFTokenizer
from engine.checkpoints.reshape import CheckpointManifest, ReshapeError, needs_conversion
from tests.support.streaming import offline  # noqa: F401 (a fixture: pytest finds it by name)

EOS = 0
SAMPLE_TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"

# Files of documents (for .txt, each file's text is its one document). The first two files pack to
# 13 tokens each: at seq_len 3 and 2 windows a micro-batch, a position is saved every 6 tokens, so
# one lands on token 12, the last of the first file a rank reads, whichever rank that is.
ROW_FILES = [["abcde", "fg", "hijk"], ["lmnopqr", "stuvw"], ["xy"], ["zabcdefghij", "", "kl"]]
TEXT_FILES = ["ab\ncd\n\nefg\nij", "klmn\nopqrstu\n", "v\n", "wxyz\n\n\nabc"]
SEQ_LEN, MICRO_BATCH = 3, 2


class EosBytes(ByteTokenizer):
    """UTF-8 bytes with an end-of-text id, so document boundaries show in the stream; letters never encode to 0."""

    @property
    def eos_id(self) -> int:
        return EOS


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A small byte-level BPE tokenizer with an end-of-text token, as tests/unit/test_data.py builds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator([SAMPLE_TEXT] * 20, trainer)
    directory = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(directory)
    return HFTokenizer(directory)


def write_jsonl(path: Path, documents: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": document, "id": i}) + "\n" for i, document in enumerate(documents)))
    return path


def write_corpus(directory: Path, kind: str) -> list[Path]:
    directory.mkdir()
    if kind == "txt":
        paths = [directory / f"part{i}.txt" for i in range(len(TEXT_FILES))]
        for path, text in zip(paths, TEXT_FILES, strict=True):
            path.write_text(text)
        return paths
    return [write_jsonl(directory / f"part{i}.jsonl", documents) for i, documents in enumerate(ROW_FILES)]


def documents_of(kind: str) -> list[list[str]]:
    return [[text] for text in TEXT_FILES] if kind == "txt" else ROW_FILES


def packed_stream(
    files: list[list[str]], encode: Callable[[str], list[int]], eos: int | None, epochs: int
) -> tuple[list[int], list[int], list[int]]:
    """The rank's token stream cut by hand: its files' documents, epoch after epoch, eos between
    consecutive ones. Returns (tokens, the document each token belongs to, -1 for eos; the offsets
    of the first epoch's file ends)."""
    tokens, owners, file_ends, document = [], [], [], 0
    for epoch in range(epochs):
        for file in files:
            for text in file:
                if document > 0 and eos is not None:
                    tokens.append(eos)
                    owners.append(-1)
                ids = encode(text)
                tokens += ids
                owners += [document] * len(ids)
                document += 1
            if epoch == 0:
                file_ends.append(len(tokens) - 1)
    return tokens, owners, file_ends


def micro_batches_by_hand(tokens: list[int], count: int) -> list[dict[str, torch.Tensor]]:
    batches = []
    for k in range(count):
        windows = [
            torch.tensor(tokens[start : start + SEQ_LEN + 1])
            for start in range(k * MICRO_BATCH * SEQ_LEN, (k + 1) * MICRO_BATCH * SEQ_LEN, SEQ_LEN)
        ]
        assert all(len(window) == SEQ_LEN + 1 for window in windows), "the hand-cut stream is too short"
        batches.append(
            {"input_ids": torch.stack([w[:-1] for w in windows]), "labels": torch.stack([w[1:] for w in windows])}
        )
    return batches


def assert_same_batches(actual: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert got.keys() == want.keys() == {"input_ids", "labels"}
        for key in want:
            assert got[key].dtype == torch.int64 and torch.equal(got[key], want[key]), key


def take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


def round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
@pytest.mark.parametrize(("dp_size", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_saved_position_resumes_to_exactly_the_uninterrupted_micro_batches(tmp_path, kind, dp_size, rank):
    """Saved after every micro-batch, round-tripped through torch.save and loaded into a fresh
    object: the next micro-batches are the uninterrupted run's. The cut points include one inside
    a document, one at a file boundary and ones after the epoch wrap, as the hand-cut stream shows."""
    paths = [str(path) for path in write_corpus(tmp_path / "corpus", kind)]
    count, tokenizer = 20, EosBytes()
    # 4 files over 2 ranks: whole files, every dp_size-th one.
    files = documents_of(kind)[rank::dp_size]
    tokens, owners, file_ends = packed_stream(files, tokenizer.encode, EOS, epochs=10)
    epoch_length = len(packed_stream(files, tokenizer.encode, EOS, epochs=1)[0])
    cuts = [k * MICRO_BATCH * SEQ_LEN for k in range(count)]
    assert any(cut in file_ends for cut in cuts), "no position saved at a file boundary"
    assert any(owners[cut] == owners[cut + 1] != -1 for cut in cuts), "no position saved inside a document"
    assert any(cut > epoch_length for cut in cuts), "no position saved after the epoch wrap"

    def windows() -> StreamedWindows:
        return StreamedWindows(
            paths, text_field="text", tokenizer=tokenizer, seq_len=SEQ_LEN, dp_rank=rank, dp_size=dp_size
        )

    uninterrupted = windows()
    batches, states, reference = stream_micro_batches(uninterrupted, MICRO_BATCH), [uninterrupted.state_dict()], []
    for _ in range(count):
        reference.append(next(batches))
        states.append(uninterrupted.state_dict())
    assert_same_batches(reference, micro_batches_by_hand(tokens, count))
    assert states[-1]["epoch"] >= 1

    longest_document = max(len(tokenizer.encode(text)) for file in files for text in file)
    for k in range(count):
        assert states[k]["tokens"].numel() <= longest_document + 1 + SEQ_LEN, "the state holds more than a document"
        resumed = windows()
        resumed.load_state_dict(round_trip(states[k]))
        following = take(stream_micro_batches(resumed, MICRO_BATCH), min(3, count - k))
        assert_same_batches(following, reference[k : k + len(following)])
        after = states[k + len(following)]
        assert resumed.state_dict()["epoch"] == after["epoch"]
        assert torch.equal(resumed.state_dict()["tokens"], after["tokens"])


def test_windows_are_cut_from_the_rows_with_eos_between_documents(tmp_path, hf_tokenizer):
    documents = [SAMPLE_TEXT[:40], SAMPLE_TEXT[40:], "nobler", "to be"]
    path = write_jsonl(tmp_path / "rows.jsonl", documents)
    stream = StreamedWindows(
        str(path), text_field="text", tokenizer=hf_tokenizer, seq_len=SEQ_LEN, dp_rank=0, dp_size=1
    )
    tokens, _, _ = packed_stream([documents], hf_tokenizer.encode, hf_tokenizer.eos_id, epochs=3)
    assert hf_tokenizer.eos_id is not None and tokens.count(hf_tokenizer.eos_id) == 11
    count = (len(tokens) - 1) // (MICRO_BATCH * SEQ_LEN)  # two epochs and more: the stream runs on across the wrap
    assert_same_batches(take(stream_micro_batches(stream, MICRO_BATCH), count), micro_batches_by_hand(tokens, count))


def test_a_txt_file_is_one_document_of_its_lines(tmp_path):
    """No separator between a file's lines, eos between files and between epochs, even for a single file."""
    paths = write_corpus(tmp_path / "corpus", "txt")[:2]
    for sources in ([paths[0]], paths):
        stream = StreamedWindows(
            sources, text_field="ignored", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=0, dp_size=1
        )
        files = [[path.read_text()] for path in sources]
        tokens, _, _ = packed_stream(files, EosBytes().encode, EOS, epochs=4)
        count = (len(tokens) - 1) // (MICRO_BATCH * SEQ_LEN)
        assert_same_batches(
            take(stream_micro_batches(stream, MICRO_BATCH), count), micro_batches_by_hand(tokens, count)
        )


def test_a_directory_is_its_files_in_sorted_order(tmp_path):
    directory = tmp_path / "corpus"
    directory.mkdir()
    for name, documents in [("c", ["third"]), ("a", ["first", "one"]), ("b", ["second"])]:
        write_jsonl(directory / f"{name}.jsonl", documents)
    stream = StreamedWindows(directory, text_field="text", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=0, dp_size=1)
    tokens, _, _ = packed_stream([["first", "one"], ["second"], ["third"]], EosBytes().encode, EOS, epochs=2)
    count = (len(tokens) - 1) // (MICRO_BATCH * SEQ_LEN)
    assert_same_batches(take(stream_micro_batches(stream, MICRO_BATCH), count), micro_batches_by_hand(tokens, count))

    (directory / "d.txt").write_text("text")
    with pytest.raises(ValueError, match="mix formats"):
        StreamedWindows(directory, text_field="text", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=0, dp_size=1)


@pytest.mark.parametrize("sizes", [[5, 4, 6], [4, 3, 5, 3]], ids=["every-other-row", "whole-files"])
def test_two_ranks_read_disjoint_rows_that_together_are_all_of_them(tmp_path, sizes):
    """3 files do not split over 2 ranks, so each reads every other row; 4 files do, so each reads whole files."""
    files, row = [], 0
    for i, size in enumerate(sizes):
        files.append([f"r{row + j:03d}" for j in range(size)])
        write_jsonl(tmp_path / f"part{i}.jsonl", files[-1])
        row += size
    rows = [text for file in files for text in file]
    seen = []
    for rank in range(2):
        stream = StreamedWindows(tmp_path, text_field="text", tokenizer=EosBytes(), seq_len=5, dp_rank=rank, dp_size=2)
        # A row is 4 bytes and an eos follows it: window k's inputs are the rank's row k, then eos.
        windows = take(stream, len(rows))
        assert all(window["input_ids"][-1] == EOS for window in windows)
        seen.append({bytes(window["input_ids"][:-1].tolist()).decode() for window in windows})
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(rows)
    if len(sizes) % 2:
        assert seen == [set(rows[0::2]), set(rows[1::2])]
    else:
        assert seen == [set(files[0] + files[2]), set(files[1] + files[3])]


def test_a_position_saved_on_other_data_parallel_ranks_is_refused(tmp_path):
    paths = write_corpus(tmp_path / "corpus", "jsonl")
    saved = StreamedWindows(paths, text_field="text", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=0, dp_size=2)
    take(saved, 3)
    state = round_trip(saved.state_dict())
    one_rank = StreamedWindows(paths, text_field="text", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=0, dp_size=1)
    with pytest.raises(
        ValueError,
        match="saved by 2 data-parallel ranks, each of which had its own position in the "
        "stream, so the resume must run on 2 data-parallel ranks, not 1",
    ):
        one_rank.load_state_dict(state)
    other_rank = StreamedWindows(paths, text_field="text", tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=1, dp_size=2)
    with pytest.raises(ValueError, match="is data-parallel rank 0's; rank 1 must load the position it saved itself"):
        other_rank.load_state_dict(state)


def test_a_string_that_names_no_local_path_streams_a_hub_dataset(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", ["hub rows"])
    local_load = datasets.load_dataset
    calls = []

    def load_from_hub(*args, **kwargs):
        calls.append((args, kwargs))
        return local_load("json", data_files=[str(path)], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load_from_hub)
    stream = StreamedWindows("org/corpus", text_field="text", tokenizer=EosBytes(), seq_len=3, dp_rank=0, dp_size=1)
    assert bytes(next(stream)["input_ids"].tolist()) == b"hub"
    assert calls == [(("org/corpus",), {"split": "train", "streaming": True})]


def test_unusable_sources_are_reported(tmp_path):
    def windows(source, text_field="text", dp_size=1):
        stream = StreamedWindows(
            source, text_field=text_field, tokenizer=EosBytes(), seq_len=SEQ_LEN, dp_rank=dp_size - 1, dp_size=dp_size
        )
        return next(stream)

    with pytest.raises(ValueError, match="does not exist"):
        windows(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "rows.jsonl", ["only row"])
    with pytest.raises(ValueError, match=r"has no column 'body' \(columns: text, id\)"):
        windows(path, text_field="body")
    with pytest.raises(ValueError, match="rank 1 of 2 read no text"):
        windows(path, dp_size=2)


def test_a_streamed_checkpoint_resumes_only_on_its_own_layout(tmp_path: Path):
    """Positions are kept rank by rank, and a pipeline's middle stages read none: any other split of the
    ranks, even at the same data-parallel size, would look up positions that were never saved."""

    def record(data: int, pipeline: int, streamed: bool = True) -> CheckpointManifest:
        return CheckpointManifest("deepspeed", data, pipeline, 1, 1, 256, 2, "byte", 8, None, streamed)

    assert needs_conversion(record(2, 1), record(2, 1), tmp_path) is False
    with pytest.raises(ReshapeError, match=r"saved by 2 data-parallel ranks .* this run is .* 2 x 2 x 1"):
        needs_conversion(record(2, 1), record(2, 2), tmp_path)
    with pytest.raises(
        ReshapeError, match="data.streaming: .* trained with data.streaming true and this run has false"
    ):
        needs_conversion(record(2, 1), replace(record(2, 1, streamed=False), train_samples=100), tmp_path)
