"""Prepared conversations as training samples: one conversation per sample, or whole conversations
packed into windows of `seq_len` tokens.

A sample holds `input_ids`, `labels` already shifted (labels[t] is the target of position t, the next
token where the loss mask marks it, else -100), and packed, `position_ids`. A conversation's last
position predicts nothing: the token after it belongs to no one. Attention never crosses
conversations: unpacked, each is alone in its row and padded on the right; packed, the positions
restart at 0 at each one, and transformers builds the block-diagonal causal mask from them when no attention mask is
given (`masking_utils.find_packed_sequence_indices`; flash attention reads the same positions).
torch is imported where a sample is made, so that building the datasets (`validate` does) needs none
(data/text.py says why).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from data.tokens.files import PreparedCorpus
from models.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from torch import Tensor

PAD_MULTIPLE = 8
"""Micro-batches of single conversations are padded to a multiple of this many tokens: shapes that
tensor cores tile, and fewer distinct shapes for a compiled model."""
PAD_ID = 0
"""The id under padding: never attended to by a real token (right padding, or its own positions in a
packed window) and never a target, so any valid id serves."""
EXCESS_LENGTH = ("raise", "truncate")


@dataclass(frozen=True)
class Conversations:
    """The conversations of one prepared split: ids and loss mask end to end (memory-mapped), where each
    conversation starts (with the end appended), and which file and record each came from."""

    tokens: np.ndarray
    mask: np.ndarray
    bounds: np.ndarray
    files: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, prepared: PreparedCorpus, split: str) -> Conversations:
        starts = np.asarray(prepared.document_starts(split), dtype=np.int64)
        tokens = prepared.tokens(split)
        files = tuple((label, count) for label, count in prepared.meta["splits"][split]["files"])
        return cls(tokens, prepared.loss_mask(split), np.append(starts, len(tokens)), files)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds)

    @property
    def targets(self) -> np.ndarray:
        """Each conversation's target tokens (its first token is never one: nothing predicts it), in
        one pass over the mask."""
        counts = np.zeros(len(self), dtype=np.int64)
        filled = np.flatnonzero(self.lengths > 1)
        if len(filled):
            # Sums over [start + 1, end) of each, and over the gaps between them, taken every other one;
            # the last sum runs to the end of the mask where the last conversation ends there.
            edges = np.stack([self.bounds[filled] + 1, self.bounds[filled + 1]], axis=1).reshape(-1)
            if edges[-1] == len(self.mask):
                edges = edges[:-1]
            counts[filled] = np.add.reduceat(self.mask, edges, dtype=np.int64)[::2]
        return counts

    def where(self, index: int) -> str:
        """ "FILE record N" of conversation `index` (records count from 1 in each file)."""
        for label, count in self.files:
            if index < count:
                return f"{label} record {index + 1}"
            index -= count
        raise IndexError(f"conversation {index} is past the split's files")

    def sample(self, index: int, length: int) -> tuple[Tensor, Tensor]:
        """The first `length` ids of conversation `index` and their shifted labels."""
        import torch

        start = int(self.bounds[index])
        ids = torch.from_numpy(self.tokens[start : start + length].astype(np.int64))
        targets = torch.from_numpy(self.mask[start + 1 : start + length].astype(bool))
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        labels[:-1] = torch.where(targets, ids[1:], IGNORE_INDEX)
        return ids, labels


@dataclass(frozen=True)
class Selection:
    """Which conversations a dataset serves, in order, and how many of each one's tokens."""

    indices: np.ndarray
    lengths: np.ndarray


def select(
    conversations: Conversations,
    indices: np.ndarray,
    *,
    seq_len: int,
    excess_length: str,
    setting: str = "data.excess_length_strategy",
) -> Selection:
    """The conversations at `indices` cut to at most `seq_len` tokens ("truncate") or refused naming
    the first too long ("raise"). One left with no target (truncated before its first answer, say)
    trains nothing and is left out."""
    if excess_length not in EXCESS_LENGTH:
        raise ValueError(f"{setting}: {excess_length!r} is neither of {', '.join(EXCESS_LENGTH)}")
    lengths = conversations.lengths[indices]
    too_long = np.flatnonzero(lengths > seq_len)
    if len(too_long) and excess_length == "raise":
        first = int(indices[too_long[0]])
        raise ValueError(
            f"{conversations.where(first)}: the conversation is {int(lengths[too_long[0]])} tokens, longer than "
            f"data.seq_len {seq_len} ({len(too_long)} of {len(indices)} are); raise data.seq_len, or set "
            f'{setting} to "truncate" to keep their first {seq_len} tokens'
        )
    kept = np.minimum(lengths, seq_len)
    targets = conversations.targets[indices]
    for position in too_long:  # truncated: count again what is left
        start = int(conversations.bounds[indices[position]])
        targets[position] = conversations.mask[start + 1 : start + seq_len].sum()
    trains = targets > 0
    return Selection(indices[trains], kept[trains])


class PadToLongest:
    """Collates conversations of different lengths: each padded on the right to the longest rounded up
    to a multiple of PAD_MULTIPLE (never past `limit`, data.seq_len), padding labelled IGNORE_INDEX.
    No position ids: right padding under causal attention is never seen by a real token, and without
    them the model keeps its plain causal attention (SDPA's `is_causal` kernels) rather than an
    explicit mask."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, samples: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
        import torch

        longest = max(len(sample["input_ids"]) for sample in samples)
        width = min(math.ceil(longest / PAD_MULTIPLE) * PAD_MULTIPLE, max(self.limit, longest))
        batch = {
            "input_ids": torch.full((len(samples), width), PAD_ID, dtype=torch.long),
            "labels": torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long),
        }
        for row, sample in enumerate(samples):
            length = len(sample["input_ids"])
            batch["input_ids"][row, :length] = sample["input_ids"]
            batch["labels"][row, :length] = sample["labels"]
        return batch


class ConversationSamples:
    """One conversation per sample, of its own length; `collate` pads a micro-batch of them."""

    def __init__(self, conversations: Conversations, selection: Selection, seq_len: int) -> None:
        self.conversations, self.selection, self.seq_len = conversations, selection, seq_len
        self.collate = PadToLongest(seq_len)

    def __len__(self) -> int:
        return len(self.selection.indices)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        length = int(self.selection.lengths[index])
        ids, labels = self.conversations.sample(int(self.selection.indices[index]), length)
        return {"input_ids": ids, "labels": labels}


class PackedConversations:
    """Windows of exactly `seq_len` tokens, each holding whole conversations, filled greedily in file
    order (a conversation that does not fit opens the next window): deterministic, and one pass
    however many conversations. The tail of a window is padding: PAD_ID, labels IGNORE_INDEX and
    positions restarting at 0, so it is a sequence of its own that no conversation attends to."""

    def __init__(self, conversations: Conversations, selection: Selection, seq_len: int) -> None:
        self.conversations, self.selection, self.seq_len = conversations, selection, seq_len
        self.windows = pack(selection.lengths, seq_len)

    def __len__(self) -> int:
        return len(self.windows) - 1

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        import torch

        ids = torch.full((self.seq_len,), PAD_ID, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        positions = torch.empty(self.seq_len, dtype=torch.long)
        offset = 0
        for member in range(int(self.windows[index]), int(self.windows[index + 1])):
            length = int(self.selection.lengths[member])
            ids[offset : offset + length], labels[offset : offset + length] = self.conversations.sample(
                int(self.selection.indices[member]), length
            )
            positions[offset : offset + length] = torch.arange(length)
            offset += length
        positions[offset:] = torch.arange(self.seq_len - offset)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def pack(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Window boundaries over conversations of `lengths` (each at most `seq_len`), greedily in order:
    window w holds conversations bounds[w] to bounds[w + 1]."""
    bounds, used = [0], 0
    for index, length in enumerate(lengths.tolist()):
        if used + length > seq_len:
            bounds.append(index)
            used = 0
        used += length
    bounds.append(len(lengths))
    return np.asarray(bounds if len(lengths) else [0], dtype=np.int64)
