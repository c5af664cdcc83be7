"""Random draws keyed by what identifies them, never by how many draws came before.

Keying every draw on a tuple such as (seed, epoch, index) is what makes data order and
augmentation independent of worker count and reproducible after a resume: a process can
compute any sample without replaying the ones before it.
"""

import numpy as np


def derive_seed(*keys: int) -> int:
    """Mix non-negative integer keys into one 64-bit seed.

    SeedSequence hashes the whole tuple, so (seed=1, epoch=0) and (seed=0, epoch=1) get
    unrelated seeds, which `seed + epoch` would not give.
    """
    return int(np.random.SeedSequence(keys).generate_state(1, dtype=np.uint64)[0])


def keyed_rng(*keys: int) -> np.random.Generator:
    """A generator whose whole stream is a pure function of `keys`."""
    return np.random.default_rng(np.random.SeedSequence(keys))
