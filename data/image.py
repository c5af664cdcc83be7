"""Labelled image datasets: a CIFAR-10 python-pickle directory or an imagefolder directory.

How the epoch reaches augmentation: the training sampler (data/loader.py) yields keys
`epoch * len(dataset) + index`; the loader splits a key with divmod and calls
`ImageDataset.sample(index, epoch)`, which draws crop and flip from a generator seeded with
(seed, epoch, index). Nothing is carried in worker state, so the augmented image is the same
for any worker count and after any resume, and changes from one epoch to the next.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from data.hf_local import load_local_dataset
from data.seeding import keyed_rng
from data.transforms import ImageTransform

if TYPE_CHECKING:
    import datasets

# `datasets` is imported where a folder is read: the config's checks import this module through the data
# kinds, and a launch's pre-flight must not pay for it.

CIFAR_DIRECTORY = "cifar-10-batches-py"
CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH = "test_batch"
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
"""CIFAR-10's label names in label order, as its batches.meta lists them."""
VALIDATION_SPLITS = ("validation", "test")

HOLDOUT_SEED = 0
"""Fixed, not the run seed, so runs with different seeds are evaluated on the same images."""


class ImageSource(Protocol):
    """Undecoded, untransformed images with integer labels."""

    def __len__(self) -> int: ...

    def image(self, index: int) -> Tensor:
        """uint8 [3, H, W]."""
        ...

    def label(self, index: int) -> int: ...


class TensorImages:
    """Images already decoded into one uint8 tensor [N, 3, H, W], as CIFAR-10 ships them."""

    def __init__(self, images: Tensor, labels: Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def image(self, index: int) -> Tensor:
        return self.images[index]

    def label(self, index: int) -> int:
        return int(self.labels[index])


class FolderImages:
    """An imagefolder split, decoded one image at a time so the folder never sits in memory."""

    def __init__(self, dataset: datasets.Dataset, indices: Sequence[int] | None = None) -> None:
        self.dataset = dataset
        self.indices = list(range(len(dataset))) if indices is None else list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def image(self, index: int) -> Tensor:
        picture = self.dataset[self.indices[index]]["image"].convert("RGB")
        return torch.from_numpy(np.array(picture)).permute(2, 0, 1)

    def label(self, index: int) -> int:
        return int(self.dataset[self.indices[index]]["label"])


class ImageDataset(Dataset):
    """`{"pixel_values": float [3, S, S], "labels": long []}` samples of an image source."""

    def __init__(self, source: ImageSource, transform: ImageTransform, seed: int) -> None:
        self.source, self.transform, self.seed = source, transform, seed

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.sample(index, epoch=0)

    def sample(self, index: int, epoch: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} images")
        rng = keyed_rng(self.seed, epoch, index)
        return {
            "pixel_values": self.transform(self.source.image(index), rng),
            "labels": torch.tensor(self.source.label(index), dtype=torch.long),
        }


@dataclass
class ImageDatasets:
    train: ImageDataset
    validation: ImageDataset
    class_names: list[str]
    """The name of each label, in label order."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def load_image_datasets(
    path: str | Path,
    *,
    image_size: int,
    augment: bool,
    mean: Sequence[float],
    std: Sequence[float],
    validation_fraction: float,
    seed: int,
) -> ImageDatasets:
    """Open a CIFAR-10 pickle directory (or its parent) or an imagefolder directory.

    Validation images are only resized, center-cropped and normalised.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path: {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"image data path {path} must be a directory (imagefolder or {CIFAR_DIRECTORY})")
    cifar_dir = path / CIFAR_DIRECTORY if is_cifar10_dir(path / CIFAR_DIRECTORY) else path
    if is_cifar10_dir(cifar_dir):
        train_source, validation_source = read_cifar10(cifar_dir)
        class_names = list(CIFAR_CLASSES)
    else:
        train_source, validation_source, class_names = read_image_folder(path, validation_fraction)

    def dataset(source: ImageSource, train: bool) -> ImageDataset:
        transform = ImageTransform(image_size=image_size, mean=mean, std=std, augment=augment and train)
        return ImageDataset(source, transform, seed)

    return ImageDatasets(
        train=dataset(train_source, train=True),
        validation=dataset(validation_source, train=False),
        class_names=class_names,
    )


def is_cifar10_dir(path: Path) -> bool:
    return all((path / name).is_file() for name in (*CIFAR_TRAIN_BATCHES, CIFAR_TEST_BATCH))


def read_cifar10(directory: Path) -> tuple[TensorImages, TensorImages]:
    """The five training batches and the test batch, the latter used for validation.

    These are the python pickles CIFAR-10 is distributed as; only open directories you trust.
    """
    train = _read_cifar_batches([directory / name for name in CIFAR_TRAIN_BATCHES])
    return train, _read_cifar_batches([directory / CIFAR_TEST_BATCH])


def read_image_folder(directory: Path, validation_fraction: float) -> tuple[FolderImages, FolderImages, list[str]]:
    """Use the folder's validation or test split, or hold out a fixed random `validation_fraction`;
    the class names are the class subdirectories' names, in label order.

    imagefolder lists images class by class. The hold-out is random rather than the last files,
    which would be one class only, and validation is read in a fixed random order, since an
    evaluation of `eval_batches` reads a prefix of it, which in folder order would score only the
    first few classes.
    """
    import datasets

    try:
        splits = load_local_dataset("imagefolder", data_dir=str(directory))
    except FileNotFoundError as error:
        raise ValueError(
            f"{directory} is neither an imagefolder (class subdirectories of images) nor a "
            f"{CIFAR_DIRECTORY} directory: {error}"
        ) from error
    if "train" not in splits:
        raise ValueError(f"imagefolder {directory} has splits {sorted(splits)} but no 'train' split")
    train = splits["train"]
    label_feature = train.features.get("label")
    if not isinstance(label_feature, datasets.ClassLabel):
        raise ValueError(f"imagefolder {directory} has no class subdirectories to take labels from")
    class_names = list(label_feature.names)

    generator = torch.Generator().manual_seed(HOLDOUT_SEED)
    validation_split = next((split for split in VALIDATION_SPLITS if split in splits), None)
    if validation_split is not None:
        validation = splits[validation_split]
        mixed = torch.randperm(len(validation), generator=generator).tolist()
        return FolderImages(train), FolderImages(validation, mixed), class_names

    num_validation = int(len(train) * validation_fraction)
    if num_validation == 0 or num_validation == len(train):
        raise ValueError(
            f"imagefolder {directory} has {len(train)} images, too few to hold out validation_fraction "
            f"{validation_fraction}; add images or a validation/ split"
        )
    order = torch.randperm(len(train), generator=generator).tolist()
    return FolderImages(train, sorted(order[num_validation:])), FolderImages(train, order[:num_validation]), class_names


def _read_cifar_batches(paths: Sequence[Path]) -> TensorImages:
    images, labels = [], []
    for path in paths:
        with path.open("rb") as file:
            batch = pickle.load(file, encoding="bytes")
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels.extend(batch[b"labels"])
    return TensorImages(torch.from_numpy(np.concatenate(images)), torch.tensor(labels, dtype=torch.long))
