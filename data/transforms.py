"""Image preprocessing in plain torch, so the engine does not depend on torchvision.

Images arrive as uint8 tensors [3, H, W]. The random choices come from a generator the
caller passes in, so the same (seed, epoch, index) always gives the same augmented image.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
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


def resize_center_crop(image: Tensor, size: int) -> Tensor:
    """Scale the shorter side to `size` and keep the centre square, as float pixels in [0, 255]."""
    height, width = image.shape[-2:]
    pixels = image.float()
    if (height, width) == (size, size):
        return pixels
    scale = size / min(height, width)
    new_height, new_width = max(size, round(height * scale)), max(size, round(width * scale))
    resized = F.interpolate(
        pixels[None], size=(new_height, new_width), mode="bilinear", antialias=True, align_corners=False
    )[0]
    top, left = (new_height - size) // 2, (new_width - size) // 2
    return resized[:, top : top + size, left : left + size]


def pad_and_crop(pixels: Tensor, padding: int, top: int, left: int) -> Tensor:
    """Zero-pad every side by `padding`, then cut the original size at (top, left) of the padded image."""
    height, width = pixels.shape[-2:]
    padded = F.pad(pixels, (padding, padding, padding, padding))
    return padded[:, top : top + height, left : left + width]


def normalize(pixels: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    mean_t = torch.tensor(mean, dtype=pixels.dtype).view(-1, 1, 1)
    std_t = torch.tensor(std, dtype=pixels.dtype).view(-1, 1, 1)
    return (pixels / 255.0 - mean_t) / std_t
