"""Tests of the data package: sharding equivalence, packing, every loader format, tokenizers,
image augmentation and synthetic data. All fixtures are tiny files written to tmp_path."""

import itertools
import json
import pickle
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset

from data import (
    DEFAULT_CORPUS,
    build_datasets,
    global_batch_indices,
    load_saved_tokenizer,
    micro_batch_indices,
)
from data.image import CIFAR_TEST_BATCH, CIFAR_TRAIN_BATCHES, load_image_datasets
from data.loader import make_eval_loader, make_train_loader
from data.sharding import epoch_permutation
from data.synthetic import SyntheticImages, SyntheticTokens
from data.text import PackedTokens, load_text_dataset
from data.tokenizers import ByteTokenizer, CharTokenizer, HFTokenizer, load_tokenizer
from data.transforms import normalize, pad_and_crop
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from models import get_family
from models.labels import IGNORE_INDEX
from tests.support.launch import ROOT
from tests.support.text_reference import token_stream

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SAMPLE_TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"


def build(config, family, seq_len=None, vocab_size=None, num_classes=None):
    return build_datasets(
        config,
        samples=get_family(family).samples,
        seed=0,
        seq_len=seq_len,
        vocab_size=vocab_size,
        num_classes=num_classes,
    )


def data_config(**overrides):
    """A data section as the engine hands it over: schema defaults filled in."""
    config = {
        "type": "text",
        "path": None,
        "tokenizer": "char",
        "text_field": "text",
        "validation_fraction": 0.1,
        "image_size": 32,
        "augment": True,
        "mean": list(MEAN),
        "std": list(STD),
        "num_samples": 1024,
        "num_workers": 0,
    }
    config.update(overrides)
    return config


class IndexDataset(Dataset):
    """Each sample names itself, so a batch shows which indices were read."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index)}


class LabelledDataset(IndexDataset):
    """Each sample's label is its index."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "labels": torch.tensor(index)}


class EpochRecordingDataset(IndexDataset):
    def sample(self, index: int, epoch: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "epoch": torch.tensor(epoch)}


def take(iterator, count):
    return list(itertools.islice(iterator, count))


# --- sharding -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_partition_the_used_samples_of_an_epoch(dp_size):
    num_samples, micro, accum, seed = 103, 2, 3, 7
    global_size = micro * accum * dp_size
    steps_per_epoch = num_samples // global_size
    seen = []
    for step, micro_step, rank in itertools.product(range(steps_per_epoch), range(accum), range(dp_size)):
        seen += micro_batch_indices(
            num_samples,
            step,
            micro_step,
            micro_batch_size=micro,
            grad_accum=accum,
            dp_rank=rank,
            dp_size=dp_size,
            seed=seed,
        )
    used = epoch_permutation(num_samples, 0, seed)[: steps_per_epoch * global_size].tolist()
    assert len(seen) == len(set(seen)) == steps_per_epoch * global_size
    assert set(seen) == set(used)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_walking_micro_steps_then_ranks_reads_the_global_batch(dp_size):
    num_samples, micro, accum, seed = 64, 2, 2, 3
    for step in range(5):
        walked = [
            index
            for micro_step in range(accum)
            for rank in range(dp_size)
            for index in micro_batch_indices(
                num_samples,
                step,
                micro_step,
                micro_batch_size=micro,
                grad_accum=accum,
                dp_rank=rank,
                dp_size=dp_size,
                seed=seed,
            )
        ]
        assert walked == global_batch_indices(num_samples, step, micro * accum * dp_size, seed)


def test_order_is_deterministic_and_changes_with_seed_and_epoch():
    first = global_batch_indices(40, 0, 8, seed=0)
    assert first == global_batch_indices(40, 0, 8, seed=0)
    assert first != global_batch_indices(40, 0, 8, seed=1)
    # 40 // 8 = 5 steps per epoch, so step 5 opens epoch 1 with a fresh shuffle.
    assert first != global_batch_indices(40, 5, 8, seed=0)
    epoch0 = [i for step in range(5) for i in global_batch_indices(40, step, 8, seed=0)]
    epoch1 = [i for step in range(5, 10) for i in global_batch_indices(40, step, 8, seed=0)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1


def test_tail_that_cannot_fill_a_global_batch_is_dropped():
    # 10 samples, batches of 4: two batches per epoch and the last 2 samples of each shuffle unused.
    used = global_batch_indices(10, 0, 4, seed=5) + global_batch_indices(10, 1, 4, seed=5)
    assert used == epoch_permutation(10, 0, seed=5)[:8].tolist()
    assert global_batch_indices(10, 2, 4, seed=5) == epoch_permutation(10, 1, seed=5)[:4].tolist()


@pytest.mark.parametrize("dp_size", [1, 2])
def test_accumulating_two_micro_batches_of_two_matches_one_micro_batch_of_four(dp_size):
    kwargs = {"dp_size": dp_size, "seed": 11}
    for step in range(6):
        accumulated = [
            micro_batch_indices(50, step, k, micro_batch_size=2, grad_accum=2, dp_rank=r, **kwargs)
            for k in range(2)
            for r in range(dp_size)
        ]
        single = [
            micro_batch_indices(50, step, 0, micro_batch_size=4, grad_accum=1, dp_rank=r, **kwargs)
            for r in range(dp_size)
        ]
        assert sum(accumulated, []) == sum(single, [])
        if dp_size == 1:
            assert accumulated[0] + accumulated[1] == single[0]


def test_train_loader_reads_exactly_the_assigned_micro_batches():
    dataset = IndexDataset(30)
    for rank in range(2):
        loader = make_train_loader(dataset, micro_batch_size=3, grad_accum=2, dp_rank=rank, dp_size=2, seed=4)
        for step, micro_step in itertools.product(range(7), range(2)):
            expected = micro_batch_indices(
                30, step, micro_step, micro_batch_size=3, grad_accum=2, dp_rank=rank, dp_size=2, seed=4
            )
            assert next(loader)["index"].tolist() == expected


def test_resumed_train_loader_yields_the_tail_of_an_uninterrupted_one():
    dataset = IndexDataset(21)
    kwargs = {"micro_batch_size": 2, "grad_accum": 2, "dp_rank": 1, "dp_size": 2, "seed": 9}
    # 21 // 8 = 2 steps per epoch, so 12 steps cross several epoch boundaries.
    full = [batch["index"].tolist() for batch in take(make_train_loader(dataset, **kwargs), 12 * 2)]
    for start_step in (1, 2, 5):
        resumed = make_train_loader(dataset, start_step=start_step, **kwargs)
        tail = [batch["index"].tolist() for batch in take(resumed, (12 - start_step) * 2)]
        assert tail == full[start_step * 2 :]


def test_worker_count_does_not_change_the_batches():
    dataset = EpochRecordingDataset(12)
    kwargs = {"micro_batch_size": 2, "grad_accum": 1, "dp_rank": 0, "dp_size": 1, "seed": 2}
    inline = take(make_train_loader(dataset, num_workers=0, **kwargs), 10)
    workers = take(make_train_loader(dataset, num_workers=2, **kwargs), 10)
    for a, b in zip(inline, workers, strict=True):
        torch.testing.assert_close(a, b)


def test_epoch_reaches_epoch_aware_datasets():
    dataset = EpochRecordingDataset(8)
    loader = make_train_loader(dataset, micro_batch_size=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0)
    # Two steps per epoch.
    epochs = [batch["epoch"].tolist() for batch in take(loader, 6)]
    assert epochs == [[0] * 4, [0] * 4, [1] * 4, [1] * 4, [2] * 4, [2] * 4]


def test_loaders_leave_the_global_torch_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    next(make_train_loader(IndexDataset(8), micro_batch_size=2, grad_accum=1, dp_rank=0, dp_size=1, seed=0))
    list(make_eval_loader(IndexDataset(8), micro_batch_size=2, dp_rank=0, dp_size=1, max_batches=2))
    torch.testing.assert_close(torch.rand(3), expected)


def test_global_batch_larger_than_dataset_is_an_error():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        global_batch_indices(5, 0, 8, seed=0)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_eval_loader_gives_every_rank_max_batches_cycling_a_small_dataset(dp_size):
    dataset = IndexDataset(5)
    per_rank = []
    for rank in range(dp_size):
        loader = make_eval_loader(dataset, micro_batch_size=2, dp_rank=rank, dp_size=dp_size, max_batches=3)
        first, second = [b["index"].tolist() for b in loader], [b["index"].tolist() for b in loader]
        assert first == second
        assert len(first) == 3 and all(len(batch) == 2 for batch in first)
        per_rank.append(first)
    # Batch b of all ranks together reads the dataset in order, wrapping around at its end.
    in_order = [i for b in range(3) for rank in range(dp_size) for i in per_rank[rank][b]]
    assert in_order == [i % 5 for i in range(3 * dp_size * 2)]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_eval_loader_counts_every_sample_once_whatever_the_world_size(dp_size: int):
    """Cycling fills every rank's batches, and the repeats' labels are ignored: the samples that count
    are the dataset's, each once."""
    dataset = LabelledDataset(5)
    counted = []
    for rank in range(dp_size):
        loader = make_eval_loader(dataset, micro_batch_size=2, dp_rank=rank, dp_size=dp_size, max_batches=3)
        for batch in loader:
            pairs = list(zip(batch["index"].tolist(), batch["labels"].tolist(), strict=True))
            assert all(label in (index, IGNORE_INDEX) for index, label in pairs)
            counted += [index for index, label in pairs if label != IGNORE_INDEX]
    assert sorted(counted) == list(range(5))


def test_eval_loader_ranks_are_disjoint_when_the_dataset_is_large_enough():
    dataset = IndexDataset(100)
    ranks = [
        [
            i
            for b in make_eval_loader(dataset, micro_batch_size=4, dp_rank=r, dp_size=2, max_batches=5)
            for i in b["index"].tolist()
        ]
        for r in range(2)
    ]
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(40))


# --- tokenizers ---------------------------------------------------------------------------------


def test_char_tokenizer_vocab_is_sorted_unique_characters_and_round_trips():
    tokenizer = CharTokenizer.from_text(SAMPLE_TEXT)
    assert tokenizer.vocab_size == len(set(SAMPLE_TEXT))
    assert tokenizer.encode("".join(sorted(set(SAMPLE_TEXT)))) == list(range(tokenizer.vocab_size))
    assert tokenizer.decode(tokenizer.encode(SAMPLE_TEXT)) == SAMPLE_TEXT
    assert CharTokenizer.from_text(SAMPLE_TEXT[::-1]).encode(SAMPLE_TEXT) == tokenizer.encode(SAMPLE_TEXT)
    with pytest.raises(ValueError, match="'Z' is not in"):
        tokenizer.encode("Z")


def test_byte_tokenizer_round_trips_any_unicode():
    tokenizer = ByteTokenizer()
    text = "naïve café — 東京 🎭"
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 256 and max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_hf_tokenizer_round_trips_and_knows_its_eos(hf_tokenizer_dir):
    tokenizer = load_tokenizer(str(hf_tokenizer_dir), training_text=None)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eos_id == 0 and tokenizer.vocab_size <= 300
    ids = tokenizer.encode(SAMPLE_TEXT)
    assert len(ids) < len(SAMPLE_TEXT)
    assert tokenizer.decode(ids) == SAMPLE_TEXT


@pytest.mark.parametrize("spec", ["char", "byte", "hf"])
def test_saved_tokenizers_load_back_identical(spec, tmp_path, hf_tokenizer_dir):
    tokenizer = load_tokenizer(str(hf_tokenizer_dir) if spec == "hf" else spec, training_text=SAMPLE_TEXT)
    tokenizer.save(tmp_path / "saved")
    loaded = load_saved_tokenizer(tmp_path / "saved")
    assert type(loaded) is type(tokenizer)
    assert loaded.vocab_size == tokenizer.vocab_size and loaded.eos_id == tokenizer.eos_id
    assert loaded.encode(SAMPLE_TEXT) == tokenizer.encode(SAMPLE_TEXT)
    assert loaded.decode(tokenizer.encode(SAMPLE_TEXT)) == SAMPLE_TEXT
    assert loaded.fingerprint == tokenizer.fingerprint


@pytest.mark.parametrize("spec", ["char", "byte", "hf"])
def test_saved_tokenizers_load_with_transformers_autotokenizer(spec, tmp_path, hf_tokenizer_dir):
    """What a user of the export reaches for first: the same ids, the same text back, the same size."""
    from transformers import AutoTokenizer

    tokenizer = load_tokenizer(str(hf_tokenizer_dir) if spec == "hf" else spec, training_text=SAMPLE_TEXT)
    tokenizer.save(tmp_path / "saved")
    auto = AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    ids = auto.encode(SAMPLE_TEXT, add_special_tokens=False)
    assert ids == tokenizer.encode(SAMPLE_TEXT) and auto.decode(ids) == SAMPLE_TEXT
    assert len(auto) == tokenizer.vocab_size and auto.eos_token_id == tokenizer.eos_id


def test_a_char_vocabulary_built_from_other_characters_has_another_fingerprint():
    """Same size, other characters: the ids mean other tokens, which a resume must not mix."""
    built = load_tokenizer("char", training_text="abcd").fingerprint
    assert load_tokenizer("char", training_text="dcba").fingerprint == built
    assert load_tokenizer("char", training_text="abce").fingerprint != built


def test_unknown_tokenizer_spec_is_named_in_the_error(tmp_path):
    with pytest.raises(ValueError, match="'gpt5-tokenizer' is neither"):
        load_tokenizer("gpt5-tokenizer", training_text=SAMPLE_TEXT)
    with pytest.raises(ValueError, match="could not load a Hugging Face tokenizer from"):
        load_tokenizer(str(tmp_path), training_text=None)
    with pytest.raises(ValueError, match="does not exist"):
        load_saved_tokenizer(tmp_path / "nothing-here")


# --- text packing and formats -------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def blocks(dataset) -> list[list[int]]:
    """Each sample's inputs, after checking that its labels are the same window one token on."""
    samples = [dataset[i] for i in range(len(dataset))]
    for sample in samples:
        assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])
    return [sample["input_ids"].tolist() for sample in samples]


def test_packing_cuts_windows_one_token_longer_than_seq_len_so_every_token_is_a_target_once():
    tokenizer = CharTokenizer.from_text(SAMPLE_TEXT)
    stream = token_stream([SAMPLE_TEXT], tokenizer)
    packed = PackedTokens(stream, seq_len=10)
    assert len(packed) == (len(SAMPLE_TEXT) - 1) // 10
    assert packed[0]["input_ids"].dtype == packed[0]["labels"].dtype == torch.long
    for i in range(len(packed)):
        assert packed[i]["input_ids"].tolist() == stream[i * 10 : (i + 1) * 10].tolist()
        assert packed[i]["labels"].tolist() == stream[i * 10 + 1 : (i + 1) * 10 + 1].tolist()
    targets = torch.cat([packed[i]["labels"] for i in range(len(packed))])
    assert targets.tolist() == stream[1 : len(packed) * 10 + 1].tolist()
    # A stream of exactly seq_len tokens has no target for its last input: no sample.
    assert len(PackedTokens(np.arange(10), seq_len=10)) == 0
    assert len(PackedTokens(np.arange(11), seq_len=10)) == 1


@pytest.mark.parametrize("stride", [1, 3])
def test_a_stride_below_seq_len_starts_a_training_window_every_stride_tokens(stride: int):
    stream = np.arange(25)
    packed = PackedTokens(stream, seq_len=10, stride=stride)
    assert blocks(packed) == [list(range(start, start + 10)) for start in range(0, 15, stride)]


def test_stride_applies_to_training_only_and_defaults_to_seq_len(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SAMPLE_TEXT * 3)
    overlapping = load_text_dataset(corpus, seq_len=10, stride=1)
    consecutive = load_text_dataset(corpus, seq_len=10)
    assert blocks(overlapping.validation) == blocks(consecutive.validation)
    assert blocks(overlapping.train)[::10] == blocks(consecutive.train)
    hardware = detect_hardware(local_world_size=1)
    config = load_config(ROOT / "configs" / "tiny_gpt.json", ["data.seq_len=32"], world_size=1, hardware=hardware)
    assert config.data.stride == 32


def test_txt_holds_out_the_last_fraction_of_tokens_for_validation(tmp_path):
    text = SAMPLE_TEXT * 4
    loaded = load_text_dataset(write(tmp_path / "a.txt", text), seq_len=8, validation_fraction=0.25)
    stream = loaded.tokenizer.encode(text)
    split = int(len(stream) * 0.75)
    assert len(loaded.train) == split // 8 and len(loaded.validation) == (len(stream) - split) // 8
    assert sum(blocks(loaded.train), []) == stream[: len(loaded.train) * 8]
    assert sum(blocks(loaded.validation), []) == stream[split : split + len(loaded.validation) * 8]


def test_several_txt_files_are_separate_documents_in_order(tmp_path):
    first, second = write(tmp_path / "1.txt", SAMPLE_TEXT), write(tmp_path / "2.txt", SAMPLE_TEXT.upper())
    # Both files have the same length, so holding out half splits the stream between them.
    loaded = load_text_dataset([str(first), str(second)], seq_len=4, validation_fraction=0.5)
    kept = len(SAMPLE_TEXT) // 4 * 4
    assert loaded.tokenizer.decode(sum(blocks(loaded.train), [])) == SAMPLE_TEXT[:kept]
    assert loaded.tokenizer.decode(sum(blocks(loaded.validation), [])) == SAMPLE_TEXT.upper()[:kept]


def test_jsonl_reads_the_configured_text_field(tmp_path):
    rows = [{"body": f"document {i}: {SAMPLE_TEXT}", "id": i} for i in range(3)]
    path = write(tmp_path / "rows.jsonl", "\n".join(json.dumps(row) for row in rows))
    loaded = load_text_dataset(path, seq_len=16, text_field="body", validation_fraction=0.2)
    assert loaded.tokenizer.decode(blocks(loaded.train)[0]) == rows[0]["body"][:16]
    with pytest.raises(ValueError, match="no column 'text'.*data.text_field"):
        load_text_dataset(path, seq_len=16)


def test_parquet_is_read_with_the_byte_tokenizer(tmp_path):
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict({"text": [SAMPLE_TEXT, SAMPLE_TEXT[::-1]]}).to_parquet(str(path))
    loaded = load_text_dataset(path, seq_len=12, tokenizer="byte", validation_fraction=0.1)
    stream = list((SAMPLE_TEXT + SAMPLE_TEXT[::-1]).encode("utf-8"))
    assert loaded.tokenizer.vocab_size == 256
    assert sum(blocks(loaded.train), []) == stream[: len(loaded.train) * 12]


def test_save_to_disk_dataset_dict_uses_its_validation_split(tmp_path):
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": [SAMPLE_TEXT] * 3}),
            "validation": datasets.Dataset.from_dict({"text": ["Who's there? Nay, answer me."]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    loaded = load_text_dataset(tmp_path / "saved", seq_len=8)
    assert len(loaded.train) == len(SAMPLE_TEXT * 3) // 8
    assert loaded.tokenizer.decode(sum(blocks(loaded.validation), [])) == "Who's there? Nay, answer me."[:24]


def test_save_to_disk_single_dataset_is_held_out_like_a_file(tmp_path):
    datasets.Dataset.from_dict({"text": [SAMPLE_TEXT] * 2}).save_to_disk(str(tmp_path / "saved"))
    loaded = load_text_dataset(tmp_path / "saved", seq_len=8, validation_fraction=0.5)
    assert len(loaded.train) == len(loaded.validation) == len(SAMPLE_TEXT) // 8


def test_default_corpus_is_embedded_and_used_when_path_is_null():
    size = DEFAULT_CORPUS.stat().st_size
    assert 25_000 <= size <= 40_000
    bundle = build(data_config(), "gpt", seq_len=64)
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    assert bundle.vocab_size == len(set(text)) == bundle.tokenizer.vocab_size
    assert len(bundle.train) == int(len(text) * 0.9) // 64
    assert bundle.tokenizer.decode(bundle.train[0]["input_ids"]) == text[:64]
    assert bundle.num_classes is None


def test_missing_path_empty_file_and_tiny_corpus_errors_name_the_file(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        load_text_dataset(missing, seq_len=8)
    empty = write(tmp_path / "empty.txt", "")
    with pytest.raises(ValueError, match=f"{empty} is empty"):
        load_text_dataset(empty, seq_len=8)
    tiny = write(tmp_path / "tiny.txt", "just a few words")
    with pytest.raises(ValueError, match=f"{tiny} is too small"):
        load_text_dataset(tiny, seq_len=8)
    with pytest.raises(ValueError, match="unsupported suffix '.csv'"):
        load_text_dataset(write(tmp_path / "t.csv", "text\nhello"), seq_len=8)
    with pytest.raises(ValueError, match=f"{missing} does not exist"):
        load_image_datasets(missing, **image_options())
    (tmp_path / "no_images").mkdir()
    with pytest.raises(ValueError, match="no_images is neither an imagefolder"):
        load_image_datasets(tmp_path / "no_images", **image_options())
    with pytest.raises(ValueError, match="no_images holds no .txt, .json, .jsonl or .parquet files"):
        load_text_dataset(tmp_path / "no_images", seq_len=8)


def test_corrupt_files_are_named_with_the_readers_reason(tmp_path):
    broken_json = write(tmp_path / "broken.jsonl", '{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(ValueError, match=rf"{broken_json} could not be read as json data: ArrowInvalid: JSON parse"):
        load_text_dataset(broken_json, seq_len=8)
    broken_parquet = tmp_path / "broken.parquet"
    broken_parquet.write_bytes(b"not a parquet file at all" * 4)
    with pytest.raises(ValueError, match=rf"{broken_parquet} could not be read as parquet data: .*magic bytes"):
        load_text_dataset(broken_parquet, seq_len=8)


# --- images -------------------------------------------------------------------------------------


def image_options(**overrides):
    options = {
        "image_size": 32,
        "augment": True,
        "mean": MEAN,
        "std": STD,
        "validation_fraction": 0.25,
        "seed": 0,
    }
    options.update(overrides)
    return options


@pytest.fixture
def cifar_dir(tmp_path):
    """A CIFAR-10 python directory in the real pickle layout: 4 images per batch."""
    directory = tmp_path / "cifar-10-batches-py"
    directory.mkdir()
    rng = np.random.default_rng(0)
    for number, name in enumerate((*CIFAR_TRAIN_BATCHES, CIFAR_TEST_BATCH)):
        batch = {
            b"batch_label": name.encode(),
            b"labels": [(number + i) % 10 for i in range(4)],
            b"data": rng.integers(0, 256, size=(4, 3072), dtype=np.uint8),
            b"filenames": [f"{name}_{i}.png".encode() for i in range(4)],
        }
        (directory / name).write_bytes(pickle.dumps(batch))
    return directory


def raw_cifar(directory: Path, name: str) -> tuple[torch.Tensor, list[int]]:
    batch = pickle.loads((directory / name).read_bytes())
    return torch.from_numpy(batch[b"data"].reshape(-1, 3, 32, 32)), batch[b"labels"]


def test_cifar_shapes_labels_and_unaugmented_validation(cifar_dir):
    images = load_image_datasets(cifar_dir.parent, **image_options())
    assert (len(images.train), len(images.validation), images.num_classes) == (20, 4, 10)
    sample = images.train[5]
    assert sample["pixel_values"].shape == (3, 32, 32) and sample["pixel_values"].dtype == torch.float32
    assert sample["labels"].shape == () and sample["labels"].dtype == torch.long
    assert sample["labels"].item() == raw_cifar(cifar_dir, "data_batch_2")[1][1]
    test_images, test_labels = raw_cifar(cifar_dir, CIFAR_TEST_BATCH)
    for index in range(4):
        expected = normalize(test_images[index].float(), MEAN, STD)
        torch.testing.assert_close(images.validation[index]["pixel_values"], expected)
        torch.testing.assert_close(images.validation.sample(index, epoch=3)["pixel_values"], expected)
        assert images.validation[index]["labels"].item() == test_labels[index]


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index(cifar_dir):
    train = load_image_datasets(cifar_dir, **image_options()).train
    again = load_image_datasets(cifar_dir, **image_options()).train
    other_seed = load_image_datasets(cifar_dir, **image_options(seed=1)).train

    def pixels(dataset, index, epoch):
        return dataset.sample(index, epoch)["pixel_values"]

    for index in range(len(train)):
        torch.testing.assert_close(pixels(train, index, 2), pixels(again, index, 2))
    assert any(not torch.equal(pixels(train, i, 0), pixels(train, i, 1)) for i in range(len(train)))
    assert any(not torch.equal(pixels(train, i, 0), pixels(other_seed, i, 0)) for i in range(len(train)))


def test_augmented_image_is_a_padded_crop_possibly_flipped(cifar_dir):
    train = load_image_datasets(cifar_dir, **image_options()).train
    original = raw_cifar(cifar_dir, "data_batch_1")[0][0].float()
    crops = {(top, left): pad_and_crop(original, 4, top, left) for top in range(9) for left in range(9)}
    candidates = {(*offset, False): crop for offset, crop in crops.items()}
    candidates |= {(*offset, True): crop.flip(-1) for offset, crop in crops.items()}
    seen_flip = seen_shift = False
    for epoch in range(6):
        augmented = train.sample(0, epoch)["pixel_values"]
        matches = [key for key, pixels in candidates.items() if torch.allclose(normalize(pixels, MEAN, STD), augmented)]
        assert matches, "the augmented image is no padded crop of the original"
        seen_flip |= any(flip for _, _, flip in matches)
        seen_shift |= any((top, left) != (4, 4) for top, left, _ in matches)
    assert seen_flip and seen_shift


@pytest.fixture
def image_folder(tmp_path):
    """Two classes of 20x24 PNGs; `with_validation` adds a validation/ split."""

    def make(with_validation: bool) -> Path:
        root = tmp_path / ("split" if with_validation else "flat")
        rng = np.random.default_rng(1)
        layouts = [("train", 4), ("validation", 2)] if with_validation else [("", 4)]
        for split, per_class in layouts:
            for label in ("cat", "dog"):
                directory = root / split / label
                directory.mkdir(parents=True)
                for i in range(per_class):
                    pixels = rng.integers(0, 256, size=(20, 24, 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(directory / f"{i}.png")
        return root

    return make


def test_image_folder_with_validation_split(image_folder):
    images = load_image_datasets(image_folder(True), **image_options(image_size=16))
    assert (len(images.train), len(images.validation), images.num_classes) == (8, 4, 2)
    assert images.class_names == ["cat", "dog"]
    assert images.train[0]["pixel_values"].shape == (3, 16, 16)
    assert sorted(images.validation[i]["labels"].item() for i in range(4)) == [0, 0, 1, 1]
    torch.testing.assert_close(images.validation[1], images.validation.sample(1, epoch=7))


def test_image_folder_validation_is_read_with_the_classes_mixed(tmp_path: Path):
    """The folder lists validation class by class, and an evaluation reads a prefix of it: in folder
    order the first batches of a 4-class set of 24 would all be class 0."""
    for split, per_class in (("train", 2), ("validation", 6)):
        for label in range(4):
            (tmp_path / split / f"class{label}").mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (8, 8), (label, i, 0)).save(tmp_path / split / f"class{label}" / f"{i}.png")
    images = load_image_datasets(tmp_path, **image_options(image_size=8))
    labels = [images.validation[i]["labels"].item() for i in range(24)]
    assert sorted(labels) == sorted(list(range(4)) * 6)
    assert len(set(labels[:8])) >= 3, labels


def test_image_folder_without_validation_holds_out_a_fixed_fraction(image_folder):
    root = image_folder(False)
    images = load_image_datasets(root, **image_options(image_size=16, validation_fraction=0.25))
    assert (len(images.train), len(images.validation), images.num_classes) == (6, 2, 2)
    other_seed = load_image_datasets(root, **image_options(image_size=16, validation_fraction=0.25, seed=3))
    validation = [images.validation[i]["pixel_values"] for i in range(2)]
    for i in range(2):
        torch.testing.assert_close(other_seed.validation[i]["pixel_values"], validation[i])
    train = [images.train[i]["pixel_values"] for i in range(6)]
    assert all(not torch.allclose(v, t) for v in validation for t in train)
    labels = [images.train[i]["labels"].item() for i in range(6)] + [
        images.validation[i]["labels"].item() for i in range(2)
    ]
    assert sorted(labels) == [0, 0, 0, 0, 1, 1, 1, 1]


# --- synthetic and build_datasets ---------------------------------------------------------------


def test_synthetic_tokens_are_deterministic_per_index():
    def tokens(seed=3, split="train"):
        return SyntheticTokens(100, seq_len=12, vocab_size=50, seed=seed, split=split)

    sample = tokens()[7]["input_ids"]
    assert sample.shape == (12,) and sample.dtype == torch.long
    assert sample.min() >= 0 and sample.max() < 50
    torch.testing.assert_close(tokens()[7]["input_ids"], sample)
    assert not torch.equal(tokens()[8]["input_ids"], sample)
    assert not torch.equal(tokens(seed=4)[7]["input_ids"], sample)
    assert not torch.equal(tokens(split="validation")[7]["input_ids"], sample)
    with pytest.raises(IndexError):
        tokens()[100]


def test_synthetic_images_have_image_shapes_and_labels():
    dataset = SyntheticImages(10, image_size=8, num_classes=3, seed=0, split="train")
    sample = dataset[2]
    assert sample["pixel_values"].shape == (3, 8, 8) and sample["pixel_values"].dtype == torch.float32
    assert sample["labels"].shape == () and 0 <= sample["labels"].item() < 3
    torch.testing.assert_close(dataset[2], SyntheticImages(10, image_size=8, num_classes=3, seed=0, split="train")[2])
    assert {dataset[i]["labels"].item() for i in range(10)} == {0, 1, 2}


def test_build_datasets_synthetic_defaults_and_sizes():
    tokens = build(data_config(type="synthetic", num_samples=50), "gpt", seq_len=16)
    assert tokens.vocab_size == 256 and tokens.tokenizer is None
    assert (len(tokens.train), len(tokens.validation)) == (50, 5)
    assert tokens.train[0]["input_ids"].shape == (16,)
    assert build(data_config(type="synthetic"), "gpt", seq_len=16, vocab_size=99).vocab_size == 99
    images = build(data_config(type="synthetic", num_samples=50, image_size=8), "resnet", num_classes=7)
    assert images.num_classes == 7 and images.vocab_size is None
    assert images.class_names is None and images.image_transform is None  # nothing for an export to carry
    assert images.train[0]["pixel_values"].shape == (3, 8, 8)


def test_build_datasets_image_and_config_errors(cifar_dir):
    bundle = build(data_config(type="image", path=str(cifar_dir)), "resnet")
    assert bundle.num_classes == 10 and len(bundle.train) == 20 and bundle.tokenizer is None
    assert bundle.class_names[:3] == ["airplane", "automobile", "bird"] and bundle.class_names[9] == "truck"
    assert bundle.image_transform == bundle.validation.transform and not bundle.image_transform.augment
    loader = make_train_loader(bundle.train, micro_batch_size=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0)
    batch = next(loader)
    assert batch["pixel_values"].shape == (4, 3, 32, 32) and batch["labels"].shape == (4,)
    assert len(build(data_config(type="image", path=[str(cifar_dir)]), "resnet").validation) == 4
    with pytest.raises(ValueError, match="data.path is required"):
        build(data_config(type="image"), "resnet")
    with pytest.raises(ValueError, match="must be one directory"):
        build(data_config(type="image", path=[str(cifar_dir)] * 2), "resnet")
    with pytest.raises(ValueError, match="'text' gives tokens, not the images"):
        build(data_config(type="text"), "resnet")
    with pytest.raises(ValueError, match="needs seq_len"):
        build(data_config(type="text"), "gpt")
