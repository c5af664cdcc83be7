"""data.type "image": an imagefolder directory or CIFAR-10's python batches (data/image.py).

data/image.py, which decodes images into tensors, is imported where the datasets are built: the
config's checks read this module through the data kinds and must not pay for torch and Pillow."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from data.bundle import DataBundle
from data.kinds.common import BuildRequest, Footprint, NothingToPrepare, first_sample_bytes

if TYPE_CHECKING:
    import datasets

GIVES = ("images",)
PATH_NEEDED = "an imagefolder or cifar-10-batches-py directory"
READS_TOKENIZER = False
MASKS_LABELS = False
# image_size, augment, mean and std stay in the shared schema: configs switch between image and synthetic
# data (data.type=synthetic on an image config) keeping them.
SCHEMA: dict = {}


def path_exists(key: str, path: str, data: Mapping[str, Any]) -> bool:
    return os.path.exists(path)


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    return iter(())


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    from data.image import load_image_datasets

    path = data["path"]
    if isinstance(path, list | tuple):
        if len(path) != 1:
            raise ValueError(f"data.path for data.type 'image' must be one directory, got {len(path)} paths")
        path = path[0]
    if path is None:
        raise ValueError("data.path is required for data.type 'image': an imagefolder or cifar-10-batches-py")
    images = load_image_datasets(
        path,
        image_size=data["image_size"],
        augment=data["augment"],
        mean=data["mean"],
        std=data["std"],
        validation_fraction=data["validation_fraction"],
        seed=request.seed,
    )
    return DataBundle(
        "image",
        images.train,
        images.validation,
        None,
        None,
        images.num_classes,
        class_names=images.class_names,
        image_transform=images.validation.transform,
    )


def footprint(bundle: DataBundle) -> Footprint:
    """CIFAR-10's pickles are read whole into every rank's memory. An imagefolder's table (paths
    and labels, in memory) and its image files count once however many splits index into it."""
    from data.image import FolderImages, ImageDataset, TensorImages

    loaded = mapped = 0
    tables: dict[int, datasets.Dataset] = {}
    for dataset in (bundle.train, bundle.validation):
        if not isinstance(dataset, ImageDataset):
            raise TypeError(f"an image bundle holds a {type(dataset).__name__}")
        if isinstance(dataset.source, TensorImages):
            loaded += dataset.source.images.nbytes + dataset.source.labels.nbytes
        elif isinstance(dataset.source, FolderImages):
            tables[id(dataset.source.dataset)] = dataset.source.dataset
    for table in tables.values():
        loaded += table.data.nbytes
        mapped += _image_file_bytes(table)
    return Footprint(first_sample_bytes(bundle.train), loaded, mapped)


def _image_file_bytes(table: datasets.Dataset) -> int:
    """The files an imagefolder table points at: decoded one at a time, read through the page cache.
    An image whose bytes the table holds itself is already in `table.data.nbytes`."""
    images = table.data.column("image").combine_chunks()
    on_disk = images.filter(images.field("bytes").is_null())
    return sum(os.path.getsize(path) for path in on_disk.field("path").to_pylist())


def prepare_ahead(data: Mapping[str, Any]) -> str:
    raise NothingToPrepare('has data.type "image": images are read as they are')
