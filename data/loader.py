"""DataLoaders that read exactly the micro-batches data/sharding.py assigns to this rank.

The training sampler yields keys `epoch * len(dataset) + index` rather than bare indices,
and `EpochKeyed` splits them again with divmod. That is how the epoch reaches a dataset whose
samples depend on it (image augmentation, through `sample(index, epoch)`) without any
`set_epoch` call that DataLoader worker copies would miss.
"""

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from data.sharding import (
    batches_per_epoch,
    check_layout,
    epoch_permutation,
    eval_batch_positions,
    micro_batch_slice,
)
from models.labels import IGNORE_INDEX


@runtime_checkable
class EpochAwareDataset(Protocol):
    """A dataset whose samples change with the epoch, such as augmented images."""

    def __len__(self) -> int: ...

    def sample(self, index: int, epoch: int) -> dict[str, Tensor]: ...


class EpochKeyed(Dataset):
    """Turns a training key back into (epoch, index) for the wrapped dataset."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self.size = len(dataset)
        self.epoch_aware = isinstance(dataset, EpochAwareDataset)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: int) -> dict[str, Tensor]:
        epoch, index = divmod(key, self.size)
        if self.epoch_aware:
            return self.dataset.sample(index, epoch)
        return self.dataset[index]


class MicroBatchSampler(Sampler[list[int]]):
    """This rank's micro-batches as lists of keys, forever, from `start_step` micro-step 0 on."""

    def __init__(
        self,
        num_samples: int,
        *,
        micro_batch_size: int,
        grad_accum: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        start_step: int = 0,
    ) -> None:
        check_layout(micro_batch_size=micro_batch_size, grad_accum=grad_accum, dp_rank=dp_rank, dp_size=dp_size)
        if start_step < 0:
            raise ValueError(f"start_step must be non-negative, got {start_step}")
        self.num_samples, self.seed, self.start_step = num_samples, seed, start_step
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.global_batch_size = micro_batch_size * grad_accum * dp_size
        self.batches_per_epoch = batches_per_epoch(num_samples, self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, order = -1, torch.empty(0, dtype=torch.long)
        for step in itertools.count(self.start_step):
            step_epoch, batch = divmod(step, self.batches_per_epoch)
            if step_epoch != epoch:
                # One shuffle per epoch, not per micro-step: randperm of a large corpus is not free.
                epoch, order = step_epoch, epoch_permutation(self.num_samples, step_epoch, self.seed)
            start = batch * self.global_batch_size
            global_batch = order[start : start + self.global_batch_size]
            for micro_step in range(self.grad_accum):
                positions = micro_batch_slice(
                    micro_step,
                    micro_batch_size=self.micro_batch_size,
                    dp_rank=self.dp_rank,
                    dp_size=self.dp_size,
                )
                yield [epoch * self.num_samples + index for index in global_batch[positions].tolist()]


def stack_samples(samples: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Collate dict samples into one dict of batched tensors."""
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


def collate_of(dataset: Dataset) -> Callable[[Sequence[dict[str, Tensor]]], dict[str, Tensor]]:
    """How a micro-batch of the dataset's samples is made: stacked, or by the dataset's own `collate`
    where its samples differ in length (one conversation each, padded: data/chat/samples.py). Only the
    batch's shape depends on it; which samples it holds is the sampler's arithmetic alone."""
    return getattr(dataset, "collate", stack_samples)


def make_train_loader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    grad_accum: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """An endless iterator of this rank's micro-batches: step `start_step` micro 0, micro 1, ...

    Resuming with `start_step=s` yields exactly what an uninterrupted run yields from step s.
    """
    sampler = MicroBatchSampler(
        len(dataset),
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        start_step=start_step,
    )
    loader = DataLoader(
        EpochKeyed(dataset),
        batch_sampler=sampler,
        collate_fn=collate_of(dataset),
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=_private_generator(),
    )
    return iter(loader)


def make_eval_loader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    max_batches: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """Exactly `max_batches` unshuffled batches for this rank, the same ones at every evaluation.

    Every sample counts once, whatever the world size: where the batches of all ranks need more
    samples than the set has, the repeats carry IGNORE_INDEX labels, which the loss and the counts
    of every family skip. Re-iterable, so one loader serves every evaluation of a run.
    """
    check_layout(micro_batch_size=micro_batch_size, grad_accum=1, dp_rank=dp_rank, dp_size=dp_size)
    if max_batches < 1:
        raise ValueError(f"max_batches must be at least 1, got {max_batches}")
    batches = [
        eval_batch_positions(len(dataset), batch, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
        for batch in range(max_batches)
    ]
    return DataLoader(
        _Cycled(dataset),
        batch_sampler=batches,
        collate_fn=collate_of(dataset),
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=_private_generator(),
    )


class _Cycled(Dataset):
    """`dataset` read by position: p is sample p % len, with its labels ignored past the end."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, position: int) -> dict[str, Tensor]:
        sample = self.dataset[position % len(self.dataset)]
        if position < len(self.dataset) or "labels" not in sample:
            return sample
        return {**sample, "labels": torch.full_like(sample["labels"], IGNORE_INDEX)}


def _private_generator() -> torch.Generator:
    # Starting a DataLoader iterator draws a worker base seed; without a generator of its own
    # it draws from the global torch RNG and so shifts dropout and init of the training loop.
    return torch.Generator()
