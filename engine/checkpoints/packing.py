"""How a rank's state travels to its checkpoint writer process (`trainer.async_save`): `pack` copies
it into shared memory, which the writer maps rather than receives, and `rebuild` gives the writer
back the state to torch.save."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch

_ALIGNMENT = 64  # bytes: every small tensor's slot starts where any dtype may be viewed
_OWN_STORAGE = 1 << 20  # bytes: a tensor this large is copied into shared memory of its own


class Slot(NamedTuple):
    """Where a tensor of the state lies in the file's shared buffer."""

    offset: int  # bytes
    dtype: torch.dtype
    shape: tuple[int, ...]


class Packed(NamedTuple):
    """A file's state as the writer process takes it (`pack`)."""

    skeleton: Any  # the state, large tensors as shared copies, small ones as their `Slot` in `small`
    small: torch.Tensor  # the small tensors' bytes, in one shared buffer
    large: list[torch.Tensor]  # the shared storages of the large tensors, as uint8, in order


def pack(state: Any, reuse: Packed | None = None) -> Packed:
    """A copy of `state` in shared memory that the writer process maps rather than receives.

    Each large tensor is copied into shared memory of its own, which torch.save writes as it writes
    DeepSpeed's clones: one storage per tensor, so the file is the one a synchronous save writes.
    Small tensors share one buffer (one file descriptor for hundreds of scalars), which the writer
    clones apart. `reuse` is this file's last `Packed`, written by now: its memory is used again
    where the sizes match (already mapped, it copies faster than fresh pages fault in). Anything
    else is deep-copied: DeepSpeed's loss scaler is an object whose scale moves on, and the queue
    pickles it later, on its own thread."""
    spare = list(reuse.large) if reuse is not None else []
    large: list[torch.Tensor] = []
    small: list[tuple[Slot, torch.Tensor]] = []
    size = 0

    # A tensor met twice (a tied weight, under both its names) is one copy, as torch.save keeps it one.
    copies: dict[tuple, Slot | torch.Tensor] = {}

    def skeleton(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
            if key not in copies:
                copies[key] = tensor_copy(value.detach())
            return copies[key]
        if isinstance(value, dict):
            copied = copy.copy(value)  # its type and attributes: a state_dict's `_metadata` versions
            if hasattr(copied, "__dict__"):
                copied.__dict__ = copy.deepcopy(value.__dict__)
            for key, item in value.items():
                copied[key] = skeleton(item)
            return copied
        if type(value) in (list, tuple):
            return type(value)(skeleton(item) for item in value)
        return copy.deepcopy(value)  # torch.Size among them: a tuple of its own type

    def tensor_copy(value: torch.Tensor) -> Slot | torch.Tensor:
        nonlocal size
        nbytes = value.numel() * value.element_size()
        if nbytes < _OWN_STORAGE:
            slot = Slot(size, value.dtype, tuple(value.shape))
            small.append((slot, value))
            size += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
            return slot
        index = len(large)
        fits = index < len(spare) and spare[index].numel() == nbytes
        storage = spare[index] if fits else shared_buffer(nbytes)
        large.append(storage)
        return storage.view(value.dtype).view(value.shape).copy_(value)

    packed = skeleton(state)
    fits = reuse is not None and reuse.small.numel() >= size
    buffer = reuse.small[:size] if fits else shared_buffer(size)
    for slot, source in small:
        nbytes = source.numel() * source.element_size()
        buffer[slot.offset : slot.offset + nbytes].view(source.dtype).view(source.shape).copy_(source)
    return Packed(packed, buffer, large)


def shared_buffer(size: int) -> torch.Tensor:
    """`size` bytes in shared memory, as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(max(size, 1)), 0, (size,))


def rebuild(value: Any, buffer: torch.Tensor, clones: dict[Slot, torch.Tensor] | None = None) -> Any:
    """`value` with each `Slot` replaced by a copy of its bytes in `buffer`, as a tensor; a slot
    met twice (a tied weight) is one tensor, as it was in the state saved."""
    clones = {} if clones is None else clones
    if isinstance(value, Slot):
        if value not in clones:
            size = torch.Size(value.shape).numel() * torch.empty((), dtype=value.dtype).element_size()
            clones[value] = buffer[value.offset : value.offset + size].view(value.dtype).reshape(value.shape).clone()
        return clones[value]
    if isinstance(value, dict):
        rebuilt = copy.copy(value)  # its type and attributes (a state_dict's `_metadata`)
        for key, item in value.items():
            rebuilt[key] = rebuild(item, buffer, clones)
        return rebuilt
    if type(value) in (list, tuple):
        return type(value)(rebuild(item, buffer, clones) for item in value)
    return value
