"""The interface the training loop programs against."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch


class Backend(ABC):
    """A model made trainable by some distributed library.

    `model` is what the loss functions call: it forwards to the user's module whatever wraps it.
    `step()` is called after every micro-batch's backward; the backend decides whether that
    micro-step closes an accumulation window and runs the optimizer.
    """

    model: torch.nn.Module
    device: torch.device

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def step(self) -> None: ...

    @abstractmethod
    def learning_rate(self) -> float: ...

    @abstractmethod
    def train(self, mode: bool = True) -> None: ...

    @abstractmethod
    def save(self, checkpoint_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank writes its part of checkpoint `tag` under `checkpoint_dir` (collective)."""

    @abstractmethod
    def load(self, checkpoint_dir: Path, tag: str) -> dict[str, Any]:
        """Every rank restores checkpoint `tag`; returns the client state saved with it."""

    @abstractmethod
    def consolidated_state_dict(self, checkpoint_dir: Path, tag: str) -> dict[str, torch.Tensor]:
        """The full fp32 weights of a saved checkpoint, read on one rank (no collectives)."""
