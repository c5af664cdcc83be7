"""Megatron-style tensor parallelism applied to a built model, by replacing its projection and
embedding modules with sharded ones.

The model classes stay as transformers ships them: a family lists which of its modules split by
output features (column-parallel), which by input features (row-parallel) and which hold the
vocabulary, and `apply_tensor_parallel` swaps those modules for the classes below, each holding
this rank's slice of the full weight. Every rank builds the same full model from the same seed
first, so the shards are slices of exactly the weights a single process would train.

The sharded parameters are plain tensors, so ZeRO-1/2 flatten and partition them like any other,
and DeepSpeed's pipeline stages hold them unchanged. `tensor_model_parallel` is DeepSpeed's own
marker: gradient-norm code counts a marked parameter on every tensor rank and an unmarked
(replicated) one once.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallelism.tensor_plan import TensorParallelPlan

SHARD_ATTRIBUTE = "tp_shard"


@dataclass(frozen=True)
class Shard:
    """How a parameter is cut across the tensor-parallel ranks: along `dim`, and when the weight
    fuses several projections (GPT-2's c_attn holds q, k and v side by side) each of its `chunks`
    separately, so every rank keeps whole heads of each."""

    dim: int
    chunks: int = 1


def shard_tensor(full: torch.Tensor, shard: Shard, rank: int, size: int) -> torch.Tensor:
    pieces = [chunk.chunk(size, dim=shard.dim)[rank] for chunk in full.chunk(shard.chunks, dim=shard.dim)]
    return torch.cat(pieces, dim=shard.dim).clone()


def unshard_tensors(shards: list[torch.Tensor], shard: Shard) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of `shard_tensor`)."""
    per_rank = [local.chunk(shard.chunks, dim=shard.dim) for local in shards]
    chunks = [torch.cat([pieces[index] for pieces in per_rank], dim=shard.dim) for index in range(shard.chunks)]
    return torch.cat(chunks, dim=shard.dim)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input's gradient is the sum of every rank's partial gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Sum of every rank's partial output; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.contiguous()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Every rank's slice of the last dimension, concatenated; the gradient keeps this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), tensor.shape[-1]
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[..., ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width].contiguous(), None


def _sharded_parameter(full: torch.Tensor, shard: Shard, group: dist.ProcessGroup) -> nn.Parameter:
    local = shard_tensor(full.detach(), shard, dist.get_rank(group), dist.get_world_size(group))
    parameter = nn.Parameter(local, requires_grad=full.requires_grad)
    parameter.tensor_model_parallel = True
    setattr(parameter, SHARD_ATTRIBUTE, shard)
    return parameter


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2) stores its weight as (in, out), nn.Linear as (out, in)."""
    return type(module).__name__ == "Conv1D"


class ColumnParallel(nn.Module):
    """A projection split by output features: each rank computes its slice of the output."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, chunks: int = 1):
        super().__init__()
        self.group, self.conv1d = group, _is_conv1d(module)
        self.weight = _sharded_parameter(module.weight, Shard(1 if self.conv1d else 0, chunks), group)
        self.bias = None if module.bias is None else _sharded_parameter(module.bias, Shard(0, chunks), group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = _CopyToTensorParallel.apply(hidden, self.group)
        weight = self.weight.t() if self.conv1d else self.weight
        return F.linear(hidden, weight, self.bias)


class RowParallel(nn.Module):
    """A projection split by input features: it takes a column-parallel output slice and sums the
    partial products of all ranks; the (replicated) bias is added once, after the sum."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup):
        super().__init__()
        self.group, self.conv1d = group, _is_conv1d(module)
        self.weight = _sharded_parameter(module.weight, Shard(0 if self.conv1d else 1), group)
        self.bias = module.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.conv1d else self.weight
        output = _ReduceFromTensorParallel.apply(F.linear(hidden, weight), self.group)
        return output if self.bias is None else output + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows: each rank looks up the tokens it holds and
    the sum over ranks assembles every token's vector."""

    def __init__(self, module: nn.Embedding, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.weight = _sharded_parameter(module.weight, Shard(0), group)
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.start + self.weight.shape[0])
        local_ids = (input_ids - self.start).masked_fill(outside, 0)
        vectors = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTensorParallel.apply(vectors, self.group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied output projection: this rank's vocabulary slice, gathered into full logits."""
        return _vocabulary_logits(hidden, self.weight, None, self.group)


def _vocabulary_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: dist.ProcessGroup
) -> torch.Tensor:
    local = F.linear(_CopyToTensorParallel.apply(hidden, group), weight, bias)
    return _GatherFromTensorParallel.apply(local, group)


class TiedVocabHead(nn.Module):
    """The language-model head of a tied model: the output projection of the sharded embedding."""

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.weight = embedding.weight
        self._embedding = [embedding]  # a list, so the embedding is not registered twice

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._embedding[0].logits(hidden)


class VocabParallelHead(nn.Module):
    """The language-model head of an untied model (Llama's `lm_head`), split by vocabulary rows like
    the embedding: each rank computes its slice of the logits, gathered into full logits."""

    def __init__(self, module: nn.Linear, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        self.weight = _sharded_parameter(module.weight, Shard(0), group)
        self.bias = None if module.bias is None else _sharded_parameter(module.bias, Shard(0), group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _vocabulary_logits(hidden, self.weight, self.bias, self.group)


def tied_logits(embedding: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits through a tied embedding matrix, sharded or not."""
    if isinstance(embedding, VocabParallelEmbedding):
        return embedding.logits(hidden)
    return F.linear(hidden, embedding.weight)


def apply_tensor_parallel(model: nn.Module, plan: TensorParallelPlan, group: dist.ProcessGroup) -> None:
    """Shard `model` in place across `group`; the caller built it identically on every rank."""
    size = dist.get_world_size(group)
    names = [name for name, _ in model.named_modules()]

    def matching(pattern: str) -> list[str]:
        return [name for name in names if fnmatch.fnmatchcase(name, pattern)]

    for pattern, chunks in plan.column.items():
        for name in matching(pattern):
            _replace(model, name, ColumnParallel(model.get_submodule(name), group, chunks))
    for pattern in plan.row:
        for name in matching(pattern):
            _replace(model, name, RowParallel(model.get_submodule(name), group))
    full_embedding = model.get_submodule(plan.vocab_embedding)
    head = model.get_submodule(plan.head)
    embedding = VocabParallelEmbedding(full_embedding, group)
    _replace(model, plan.vocab_embedding, embedding)
    tied = head.weight is full_embedding.weight
    _replace(model, plan.head, TiedVocabHead(embedding) if tied else VocabParallelHead(head, group))
    for pattern, attributes in plan.per_rank_attributes.items():
        for name in matching(pattern):
            module = model.get_submodule(name)
            for attribute in attributes:
                setattr(module, attribute, getattr(module, attribute) // size)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def gather_tensor_parallel(
    tensors: Mapping[str, torch.Tensor],
    shards: Mapping[str, Shard],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Full tensors from this rank's shards (a collective over `group`); replicated ones as they are.

    Each shard travels through `device`, the group's own (NCCL gathers device tensors only), and
    comes back to where `tensors` lie, so only one joined tensor at a time occupies the device."""
    full = dict(tensors)
    if group is None or dist.get_world_size(group) == 1:
        return full
    for name, shard in shards.items():
        local = tensors[name].to(device).contiguous()
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local, group=group)
        full[name] = unshard_tensors(pieces, shard).to(tensors[name].device)
    return full
