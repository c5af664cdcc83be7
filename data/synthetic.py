"""Random data for smoke tests and throughput runs, generated per sample on demand.

Each sample is a pure function of (seed, split, index), so a million samples cost no memory
and every rank, worker and resumed run sees the same values. torch is imported where a sample is
made, so that building the datasets (`validate` does) needs none (data/text.py says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.seeding import keyed_rng

if TYPE_CHECKING:
    from torch import Tensor

SPLIT_KEYS = {"train": 0, "validation": 1}
"""Part of every sample's key, so validation samples never repeat training samples."""


class _KeyedSamples:
    def __init__(self, num_samples: int, seed: int, split: str) -> None:
        if num_samples < 1:
            raise ValueError(f"a synthetic dataset needs at least one sample, got num_samples={num_samples}")
        self.num_samples, self.seed, self.split_key = num_samples, seed, SPLIT_KEYS[split]

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, index: int) -> np.random.Generator:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return keyed_rng(self.seed, self.split_key, index)


class SyntheticTokens(_KeyedSamples):
    """`{"input_ids": long [seq_len], "labels": long [seq_len]}`: a window of `seq_len + 1` tokens
    uniform in [0, vocab_size), shaped as text samples are (labels one token on)."""

    def __init__(self, num_samples: int, *, seq_len: int, vocab_size: int, seed: int, split: str) -> None:
        super().__init__(num_samples, seed, split)
        self.seq_len, self.vocab_size = seq_len, vocab_size

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        import torch

        window = torch.from_numpy(self._rng(index).integers(0, self.vocab_size, size=self.seq_len + 1)).long()
        return {"input_ids": window[:-1], "labels": window[1:]}


class SyntheticImages(_KeyedSamples):
    """`{"pixel_values": float [3, S, S], "labels": long []}`: standard normal pixels, uniform labels.

    The pixels are already on the scale normalised real images have.
    """

    def __init__(self, num_samples: int, *, image_size: int, num_classes: int, seed: int, split: str) -> None:
        super().__init__(num_samples, seed, split)
        self.image_size, self.num_classes = image_size, num_classes

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        import torch

        rng = self._rng(index)
        pixels = rng.standard_normal((3, self.image_size, self.image_size), dtype="float32")
        return {
            "pixel_values": torch.from_numpy(pixels),
            "labels": torch.tensor(int(rng.integers(0, self.num_classes)), dtype=torch.long),
        }
