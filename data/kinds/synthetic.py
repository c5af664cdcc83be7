"""data.type "synthetic": random tokens or images, a pure function of (seed, split, index), for
smoke tests and throughput runs of any family (data/synthetic.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from data.bundle import SAMPLES, DataBundle
from data.kinds.common import BuildRequest, Footprint, NothingToPrepare, first_sample_bytes
from data.synthetic import SyntheticImages, SyntheticTokens

GIVES = SAMPLES
PATH_NEEDED = None  # reads no files
READS_TOKENIZER = False
MASKS_LABELS = False
SCHEMA: dict = {}  # num_samples stays in the shared schema: configs switch to and from synthetic data

SYNTHETIC_VOCAB_SIZE = 256
SYNTHETIC_NUM_CLASSES = 10


def path_exists(key: str, path: str, data: Mapping[str, Any]) -> bool:
    return True  # its paths are never read


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    return iter(())


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    num_samples, seed = data["num_samples"], request.seed
    num_validation = max(1, int(num_samples * data["validation_fraction"]))
    if request.samples == "tokens":
        vocab = SYNTHETIC_VOCAB_SIZE if request.vocab_size is None else request.vocab_size
        seq_len = request.seq_len
        train = SyntheticTokens(num_samples, seq_len=seq_len, vocab_size=vocab, seed=seed, split="train")
        validation = SyntheticTokens(num_validation, seq_len=seq_len, vocab_size=vocab, seed=seed, split="validation")
        return DataBundle("synthetic", train, validation, None, vocab, None)
    classes = SYNTHETIC_NUM_CLASSES if request.num_classes is None else request.num_classes
    image_size = data["image_size"]
    train = SyntheticImages(num_samples, image_size=image_size, num_classes=classes, seed=seed, split="train")
    validation = SyntheticImages(
        num_validation, image_size=image_size, num_classes=classes, seed=seed, split="validation"
    )
    return DataBundle("synthetic", train, validation, None, None, classes)


def footprint(bundle: DataBundle) -> Footprint:
    """Each sample is generated when read: nothing that grows."""
    return Footprint(first_sample_bytes(bundle.train))


def prepare_ahead(data: Mapping[str, Any]) -> str:
    raise NothingToPrepare('has data.type "synthetic", generated as it is read')
