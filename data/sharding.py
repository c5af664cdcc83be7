"""Which samples each rank reads at each step: the arithmetic that makes data parallelism,
gradient accumulation and resumption see the same data as one uninterrupted process.

A run is a sequence of global batches. Epoch e is a permutation of the dataset drawn from
(seed, e); it is cut into global batches of micro * accum * dp samples and the tail that does
not fill one is dropped. Step s reads global batch s of the epochs laid end to end. Inside a
global batch, micro-step k of rank r reads positions [(k*dp + r)*micro, (k*dp + r + 1)*micro),
so walking k then r in one process visits exactly the micro-batches the ranks read.

torch is imported where an order is drawn: `validate` checks a dataset fills one global batch
(`batches_per_epoch`) and must not pay for importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.seeding import derive_seed

if TYPE_CHECKING:
    import torch

IN_MEMORY_ORDER_UP_TO = 1 << 20
"""Epochs of at most this many samples are shuffled by torch.randperm (8 MiB of int64 per rank);
larger ones by a permutation computed on the fly, whose memory does not grow with the data."""


def epoch_permutation(num_samples: int, epoch: int, seed: int) -> torch.Tensor | LazyPermutation:
    """The sample order of one epoch: a fresh shuffle per epoch, the same one for every rank.
    Sliced (`order[a:b]`) it gives the indices at those positions as a tensor."""
    import torch

    if num_samples <= IN_MEMORY_ORDER_UP_TO:
        generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
        return torch.randperm(num_samples, generator=generator)
    return LazyPermutation(num_samples, derive_seed(seed, epoch))


class LazyPermutation:
    """A pseudo-random permutation of range(n) that computes only the positions asked for.

    A randperm of every window would cost each rank 8 bytes per sample per epoch: 8 GB for a
    billion-token corpus sampled at stride 1. Megatron builds its shuffle index once on rank 0 and
    caches it as .npy; this needs neither the disk nor the coordination. It is a 4-round Feistel
    network over the smallest even number of bits covering n (a bijection on that power of two),
    walked again from any value that lands at n or above until it lands below ("cycle walking"),
    which keeps it a bijection on range(n); fewer than 4 walks are expected since 2^bits < 4n.
    """

    ROUNDS = 4

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.half_bits = max(1, (int(num_samples - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.keys = np.random.default_rng(seed).integers(0, 2**63, size=self.ROUNDS, dtype=np.uint64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, positions: slice) -> torch.Tensor:
        import torch

        values = np.arange(*positions.indices(self.num_samples), dtype=np.uint64)
        values = self._permute(values)
        outside = values >= self.num_samples
        while outside.any():
            values[outside] = self._permute(values[outside])
            outside = values >= self.num_samples
        return torch.from_numpy(values.astype(np.int64))

    def _permute(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = values >> shift, values & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << shift) | right


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit moves about half the output bits."""
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def batches_per_epoch(num_samples: int, global_batch_size: int) -> int:
    if global_batch_size < 1:
        raise ValueError(f"the global batch size must be at least 1, got {global_batch_size}")
    batches = num_samples // global_batch_size
    if batches == 0:
        raise ValueError(
            f"a dataset of {num_samples} samples cannot fill one global batch of {global_batch_size} "
            "(micro_batch_size * grad_accum * data-parallel size); use more data or a smaller batch"
        )
    return batches


def global_batch_indices(num_samples: int, step: int, global_batch_size: int, seed: int) -> list[int]:
    """The dataset indices of the global batch that step `step` of the run trains on."""
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    epoch, batch = divmod(step, batches_per_epoch(num_samples, global_batch_size))
    start = batch * global_batch_size
    return epoch_permutation(num_samples, epoch, seed)[start : start + global_batch_size].tolist()


def micro_batch_slice(micro_step: int, *, micro_batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Positions inside a global batch that rank `dp_rank` reads at micro-step `micro_step`."""
    start = (micro_step * dp_size + dp_rank) * micro_batch_size
    return slice(start, start + micro_batch_size)


def micro_batch_indices(
    num_samples: int,
    step: int,
    micro_step: int,
    *,
    micro_batch_size: int,
    grad_accum: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> list[int]:
    """The dataset indices rank `dp_rank` reads at micro-step `micro_step` of step `step`."""
    check_layout(micro_batch_size=micro_batch_size, grad_accum=grad_accum, dp_rank=dp_rank, dp_size=dp_size)
    if not 0 <= micro_step < grad_accum:
        raise ValueError(f"micro_step must be in [0, {grad_accum}), got {micro_step}")
    global_batch = global_batch_indices(num_samples, step, micro_batch_size * grad_accum * dp_size, seed)
    positions = micro_batch_slice(micro_step, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    return global_batch[positions]


def eval_batch_positions(
    num_samples: int, batch: int, *, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[int]:
    """Evaluation batch `batch` of rank `dp_rank`, as positions in the dataset read in order and
    cycled when it runs out: position p is sample p % num_samples, and a position past the end is
    a repeat, which the loader gives no weight (loader.make_eval_loader).

    Cycling lets every rank run the same number of forwards however small the validation set,
    which ZeRO-3 needs because each forward gathers parameters from all ranks.
    """
    if num_samples < 1:
        raise ValueError("the evaluation dataset is empty")
    start = (batch * dp_size + dp_rank) * micro_batch_size
    return [start + offset for offset in range(micro_batch_size)]


def check_layout(*, micro_batch_size: int, grad_accum: int, dp_rank: int, dp_size: int) -> None:
    if micro_batch_size < 1 or grad_accum < 1 or dp_size < 1:
        raise ValueError(
            f"micro_batch_size ({micro_batch_size}), grad_accum ({grad_accum}) and dp_size ({dp_size}) "
            "must all be at least 1"
        )
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
