"""ZeRO-Infinity's swappers, with two slips of DeepSpeed 0.19.8 put right around them.

- **Prefetch duplicates.** Before each submodule, `PartitionedParameterCoordinator.
  __prefetch_nvme_param_partitions` (zero/partitioned_param_coordinator.py) walks the upcoming part
  of the recorded trace and lists every parameter still on NVMe once per use: a parameter used twice
  within that window (in the forward and again in the backward of a small model, or by a module
  called twice) is listed twice, and `AsyncPartitionedParameterSwapper.swap_in` gives the first a
  buffer and fails on the second (`param 24 already assigned swap buffer id 1`, at the second step
  of a 2-layer GPT with every partition on NVMe). Each parameter is swapped in once: both uses read
  the same buffer.
- **Misaligned gradient reads.** The optimizer swapper writes each parameter's gradient piece to its
  own file through aligned staging buffers, but reads it back straight into its place in the
  sub-group's page-locked gradient buffer (`PartitionedOptimizerSwapper._swap_in_pinned_gradients`).
  DeepSpeed's async_io reads with O_DIRECT, which needs the destination address aligned, and a
  piece's place is aligned only where every parameter before it in the sub-group has a multiple of
  128 elements: a ResNet's is not (a 3x3 convolution's partition), its gradients came back wrong,
  and its NVMe run left the reference at the first update (2.478 against 2.458 in the second loss).
  A misaligned piece is read into a buffer of its own, which the op stages through an aligned one,
  and copied into place.
"""

from __future__ import annotations

from typing import Any

import torch

_INSTALLED = "_engine_repaired"


def repair_swappers() -> None:
    """Install both repairs (idempotent)."""
    from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    if not getattr(AsyncPartitionedParameterSwapper, _INSTALLED, False):
        _deduplicate_swap_in(AsyncPartitionedParameterSwapper)
        setattr(AsyncPartitionedParameterSwapper, _INSTALLED, True)
    if not getattr(PartitionedOptimizerSwapper, _INSTALLED, False):
        _align_gradient_reads(PartitionedOptimizerSwapper)
        setattr(PartitionedOptimizerSwapper, _INSTALLED, True)


def _deduplicate_swap_in(swapper: type) -> None:
    swap_in = swapper.swap_in

    def once_each(self: Any, params: list, async_op: bool = True, swap_in_buffers: list | None = None) -> None:
        if swap_in_buffers is None:  # buffers given by the caller pair with its list as it is
            params = list({id(param): param for param in params}.values())
        swap_in(self, params, async_op=async_op, swap_in_buffers=swap_in_buffers)

    swapper.swap_in = once_each


def _align_gradient_reads(swapper: type) -> None:
    from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
    from deepspeed.runtime.swap_tensor.utils import swap_in_tensors

    read_in_place = swapper._swap_in_pinned_gradients

    def aligned_reads(self: Any, aio_handle: Any, parameter: torch.Tensor, gradient_tensor: torch.Tensor) -> None:
        info = self.swap_params_info[OptimizerSwapper.parameter_id(parameter)]
        alignment = aio_handle.get_alignment()
        pieces = list(info.swapped_gradients.values())
        misaligned = [
            piece
            for piece in pieces
            if (gradient_tensor.data_ptr() + piece.offset * gradient_tensor.element_size()) % alignment
        ]
        if not misaligned:
            read_in_place(self, aio_handle, parameter, gradient_tensor)
            return
        staged = [torch.empty(piece.length, dtype=gradient_tensor.dtype) for piece in misaligned]
        swap_in_tensors(aio_handle, staged, [piece.path for piece in misaligned])
        aligned = [piece for piece in pieces if piece not in misaligned]
        swap_in_tensors(
            aio_handle,
            [gradient_tensor.narrow(0, piece.offset, piece.length) for piece in aligned],
            [piece.path for piece in aligned],
        )
        if aio_handle.wait() != len(pieces):
            raise RuntimeError(f"swapping in the gradients of {len(pieces)} pieces of sub-group {info.param_id} failed")
        for piece, buffer in zip(misaligned, staged, strict=True):
            gradient_tensor.narrow(0, piece.offset, piece.length).copy_(buffer)

    swapper._swap_in_pinned_gradients = aligned_reads
