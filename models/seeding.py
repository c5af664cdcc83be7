"""One seed for every random number generator a model build draws from."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, numpy and torch alike on every rank, so that every rank builds the same weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
