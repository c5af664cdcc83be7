"""Image preprocessing in plain torch and Pillow, so the engine does not depend on torchvision.

Images arrive as uint8 tensors [3, H, W] in RGB order. The random choices come from a generator the
caller passes in, so the same (seed, epoch, index) always gives the same augmented image.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor


@dataclass(frozen=True)
class ImageTransform:
    """Resize and center-crop to `image_size`; for training also pad-and-crop and flip; normalise.

    The training recipe is the standard CIFAR one: zero padding of `padding` pixels, a random
    `image_size` crop, a horizontal flip with probability 0.5, then (x / 255 - mean) / std.
    """

    image_size: int
    mean: Sequence[float]
    std: Sequence[float]
    augment: bool
    padding: int = 4

    def __call__(self, image: Tensor, rng: np.random.Generator) -> Tensor:
        pixels = resize_center_crop(image, self.image_size)
        if self.augment:
            top, left = (int(offset) for offset in rng.integers(0, 2 * self.padding + 1, size=2))
            pixels = pad_and_crop(pixels, self.padding, top, left)
            if rng.random() < 0.5:
                pixels = pixels.flip(-1)
        return normalize(pixels, self.mean, self.std)

    def save_image_processor(self, directory: Path) -> None:
        """Write this transform without its augmentation (a training-only step) as transformers'
        `BitImageProcessor` (preprocessor_config.json), so `AutoImageProcessor` and
        `pipeline("image-classification")` turn an image into the pixels evaluation fed the model.

        Bit's steps are this transform's, in its order: RGB, shorter side resized with Pillow's
        bilinear filter, centre crop, rescale by 1/255, normalise. ResNet's own choice,
        `ConvNextImageProcessor`, resizes to size / crop_pct first and squashes sizes of 384 and
        more to a square, which this transform never does. The file names `BitImageProcessor`
        whichever class wrote it; the Pillow one writes it here, as the other needs torchvision.
        Where torchvision imports, transformers loads it with torchvision's resize, which can be one
        grey level off Pillow's; `AutoImageProcessor.from_pretrained(..., backend="pil")` is exact.
        """
        from transformers import BitImageProcessorPil  # seconds to import; only exports need it

        size = self.image_size
        BitImageProcessorPil(
            do_convert_rgb=True,
            size={"shortest_edge": size},
            resample=Image.Resampling.BILINEAR,
            crop_size={"height": size, "width": size},
            image_mean=list(self.mean),
            image_std=list(self.std),
        ).save_pretrained(directory)


def resize_center_crop(image: Tensor, size: int) -> Tensor:
    """Scale the shorter side of a uint8 image to `size` and keep the centre square, as float pixels
    in [0, 255].

    Pillow's bilinear filter on the 8-bit image, the longer side rounded down and the crop's corner
    at half the excess rounded down: the steps of torchvision's `Resize` and `CenterCrop` on a PIL
    image and of the image processor an export carries (`ImageTransform.save_image_processor`),
    which therefore gives these pixels bit for bit.
    """
    height, width = resized_shape(image.shape[-2], image.shape[-1], size)
    if (height, width) != tuple(image.shape[-2:]):
        picture = Image.fromarray(np.ascontiguousarray(image.permute(1, 2, 0).numpy()))
        resized = picture.resize((width, height), Image.Resampling.BILINEAR)
        image = torch.from_numpy(np.array(resized)).permute(2, 0, 1)
    top, left = (height - size) // 2, (width - size) // 2
    return image[:, top : top + size, left : left + size].float()


def resized_shape(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) with the shorter side `size` and the aspect ratio kept, the longer side
    rounded down as transformers' `get_resize_output_image_size` and torchvision's `Resize` do."""
    if height <= width:
        return size, int(size * width / height)
    return int(size * height / width), size


def pad_and_crop(pixels: Tensor, padding: int, top: int, left: int) -> Tensor:
    """Zero-pad every side by `padding`, then cut the original size at (top, left) of the padded image."""
    height, width = pixels.shape[-2:]
    padded = F.pad(pixels, (padding, padding, padding, padding))
    return padded[:, top : top + height, left : left + width]


def normalize(pixels: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    mean_t = torch.tensor(mean, dtype=pixels.dtype).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype).view(-1, 1, 1)
    return (pixels / 255.0 - mean_t) / std_t
