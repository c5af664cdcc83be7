"""Datasets and data-parallel loaders built from the `data` section of a run config."""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import Dataset

from data.corpus import DEFAULT_CORPUS
from data.image import load_image_datasets
from data.loader import make_eval_loader, make_train_loader
from data.sharding import batches_per_epoch, global_batch_indices, micro_batch_indices
from data.streaming import StreamedCorpus
from data.synthetic import SyntheticImages, SyntheticTokens
from data.text import load_text_dataset
from data.tokenizers import Tokenizer, load_saved_tokenizer
from data.tokens.blend import load_token_datasets
from data.tokens.external import TokenFile
from data.transforms import ImageTransform

__all__ = [
    "DEFAULT_CORPUS",
    "DataBundle",
    "Tokenizer",
    "batches_per_epoch",
    "build_datasets",
    "global_batch_indices",
    "load_saved_tokenizer",
    "make_eval_loader",
    "make_train_loader",
    "micro_batch_indices",
]

# What a sample holds: token ids and their next-token labels, or an image and its class; and which
# of them each data.type gives.
SAMPLES = ("tokens", "images")
_GIVES = {"text": ("tokens",), "tokens": ("tokens",), "image": ("images",), "synthetic": SAMPLES}
SYNTHETIC_VOCAB_SIZE = 256
SYNTHETIC_NUM_CLASSES = 10


@dataclass
class DataBundle:
    train: Dataset
    validation: Dataset
    tokenizer: Tokenizer | None
    """Text only; saved with the export, so generation from it can decode."""
    vocab_size: int | None
    """Text and synthetic tokens: the size the model's embedding must have."""
    num_classes: int | None
    """Images and synthetic images."""
    token_files: list[TokenFile] = field(default_factory=list)
    """data.type "tokens": the files read, whose ids the model's vocabulary must cover."""
    class_names: list[str] | None = None
    """Images: each label's name; the export's labels, so a prediction names its class."""
    image_transform: ImageTransform | None = None
    """Images: the evaluation transform, saved with the export as a transformers image processor
    so the export preprocesses an image as evaluation did. Synthetic images, already pixels, have none."""


def build_datasets(
    data_cfg: Mapping[str, Any],
    *,
    samples: str,
    seed: int,
    seq_len: int | None,
    vocab_size: int | None,
    num_classes: int | None,
) -> DataBundle:
    """Build the training and validation datasets a validated `data` config section describes.

    `samples` is what the model trains on (its family's `samples`): "tokens" (samples of `seq_len`
    tokens and their next-token labels) or "images". `vocab_size` and `num_classes` come from the
    model config and size synthetic data only; real data reports its own.
    """
    data_type = data_cfg["type"]
    if samples not in SAMPLES:
        raise ValueError(f"samples {samples!r} are unknown; expected one of {', '.join(SAMPLES)}")
    if samples not in _GIVES[data_type]:
        gives = " or ".join(_GIVES[data_type])
        raise ValueError(f"data.type {data_type!r} gives {gives}, not the {samples} the model trains on")
    if samples == "tokens" and seq_len is None:
        raise ValueError("a model trained on tokens needs seq_len to cut token samples")

    if data_type == "text" and data_cfg.get("streaming"):
        return _streaming_bundle(data_cfg, seq_len)
    if data_type == "text":
        return _text_bundle(data_cfg, seq_len)
    if data_type == "tokens":
        return _tokens_bundle(data_cfg, seq_len)
    if data_type == "image":
        return _image_bundle(data_cfg, seed)
    return _synthetic_bundle(data_cfg, samples, seed, seq_len, vocab_size, num_classes)


def _text_bundle(data_cfg: Mapping[str, Any], seq_len: int) -> DataBundle:
    text = load_text_dataset(
        data_cfg["path"],
        seq_len=seq_len,
        tokenizer=data_cfg["tokenizer"],
        text_field=data_cfg["text_field"],
        validation_fraction=data_cfg["validation_fraction"],
        stride=data_cfg.get("stride", seq_len),
        cache_dir=_cache_dir(data_cfg),
        cache_timeout_s=data_cfg.get("cache_timeout_s", 3600),
    )
    return DataBundle(text.train, text.validation, text.tokenizer, text.tokenizer.vocab_size, None)


def _streaming_bundle(data_cfg: Mapping[str, Any], seq_len: int) -> DataBundle:
    """Training text streamed (data/streaming.py); the held-out text, which an evaluation reads again
    and again, prepared into the token cache like any corpus."""
    validation = load_text_dataset(
        data_cfg["validation_path"],
        seq_len=seq_len,
        tokenizer=data_cfg["tokenizer"],
        text_field=data_cfg["text_field"],
        cache_dir=_cache_dir(data_cfg),
        cache_timeout_s=data_cfg.get("cache_timeout_s", 3600),
        held_out_only=True,
    )
    train = StreamedCorpus(data_cfg["path"], data_cfg["text_field"], validation.tokenizer, seq_len)
    return DataBundle(train, validation.validation, validation.tokenizer, validation.tokenizer.vocab_size, None)


def _tokens_bundle(data_cfg: Mapping[str, Any], seq_len: int) -> DataBundle:
    tokens = load_token_datasets(
        data_cfg["path"],
        weights=data_cfg.get("weights"),
        validation_paths=data_cfg.get("validation_path"),
        dtype=data_cfg.get("dtype"),
        tokenizer=data_cfg["tokenizer"],
        seq_len=seq_len,
        stride=data_cfg.get("stride", seq_len),
        validation_fraction=data_cfg["validation_fraction"],
        cache_dir=_cache_dir(data_cfg),
    )
    return DataBundle(tokens.train, tokens.validation, tokens.tokenizer, tokens.vocab_size, None, tokens.files)


def _cache_dir(data_cfg: Mapping[str, Any]) -> str | None:
    """The configured cache folder; None (the default one) where the section was not resolved."""
    return None if data_cfg.get("cache_dir", "auto") == "auto" else data_cfg["cache_dir"]


def _image_bundle(data_cfg: Mapping[str, Any], seed: int) -> DataBundle:
    path = data_cfg["path"]
    if isinstance(path, list | tuple):
        if len(path) != 1:
            raise ValueError(f"data.path for data.type 'image' must be one directory, got {len(path)} paths")
        path = path[0]
    if path is None:
        raise ValueError("data.path is required for data.type 'image': an imagefolder or cifar-10-batches-py")
    images = load_image_datasets(
        path,
        image_size=data_cfg["image_size"],
        augment=data_cfg["augment"],
        mean=data_cfg["mean"],
        std=data_cfg["std"],
        validation_fraction=data_cfg["validation_fraction"],
        seed=seed,
    )
    return DataBundle(
        images.train,
        images.validation,
        None,
        None,
        images.num_classes,
        class_names=images.class_names,
        image_transform=images.validation.transform,
    )


def _synthetic_bundle(
    data_cfg: Mapping[str, Any],
    samples: str,
    seed: int,
    seq_len: int | None,
    vocab_size: int | None,
    num_classes: int | None,
) -> DataBundle:
    num_samples = data_cfg["num_samples"]
    num_validation = max(1, int(num_samples * data_cfg["validation_fraction"]))
    if samples == "tokens":
        vocab = SYNTHETIC_VOCAB_SIZE if vocab_size is None else vocab_size
        train = SyntheticTokens(num_samples, seq_len=seq_len, vocab_size=vocab, seed=seed, split="train")
        validation = SyntheticTokens(num_validation, seq_len=seq_len, vocab_size=vocab, seed=seed, split="validation")
        return DataBundle(train, validation, None, vocab, None)
    classes = SYNTHETIC_NUM_CLASSES if num_classes is None else num_classes
    image_size = data_cfg["image_size"]
    train = SyntheticImages(num_samples, image_size=image_size, num_classes=classes, seed=seed, split="train")
    validation = SyntheticImages(
        num_validation, image_size=image_size, num_classes=classes, seed=seed, split="validation"
    )
    return DataBundle(train, validation, None, None, classes)
