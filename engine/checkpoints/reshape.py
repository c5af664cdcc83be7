"""Resuming a checkpoint on another layout: decided before any process group starts.

Every checkpoint records the layout that saved it (`layout.json`: backend, data-, pipeline- and
tensor-parallel sizes, ZeRO stage, vocabulary, optimizer groups, tokenizer, global batch). A resume on the same
layout loads it as saved. One on another data-parallel size, ZeRO stage, tensor- or pipeline-
parallel size goes through DeepSpeed's universal checkpoint (`universal.py`): converted once, then
cut into the new partitions, Adam moments and schedule included, so training continues as if it had
never stopped. The accelerate backend's torch distributed checkpoints reshard on load, at any
process count, DDP or FSDP; across backends both ways go through the universal form (`to_torch.py`
and `from_torch.py` beside this module). The cases that cannot convert or load are refused here
with the path that works: resume on the saving layout, let it export, and start the new layout from
the export with `model.init_from` (weights only; the optimizer starts afresh).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

MANIFEST_FILE = "layout.json"
NAMES_FOLDER = "names"  # every rank's parameter and buffer names (engine/checkpoints/universal.py)
# Under NAMES_FOLDER: an fp32 ZeRO-0 checkpoint's optimizer parameters by position (from_torch.py).
OPTIMIZER_ORDER = "optimizer_order.json"


class ReshapeError(ValueError):
    """A checkpoint that cannot be resumed on this run's layout (with what to do instead)."""


@dataclass(frozen=True)
class CheckpointManifest:
    """What a checkpoint must know about the run that saved it to be resumed elsewhere (its
    `layout.json`; a run's own is written with each of its checkpoints). `tokenizer` is the
    tokenizer's fingerprint (text runs only); `train_samples` the size of the training set the data
    order was drawn over (None for a streamed corpus, read in its own order by each data-parallel
    rank, `streamed`). `lora`: the run trained model.lora's adapters, which alone it saved."""

    backend: str
    data: int
    pipeline: int
    tensor: int
    zero_stage: int
    vocab_size: int | None
    optimizer_groups: int
    tokenizer: str | None
    train_batch_size: int | None
    train_samples: int | None
    streamed: bool = False
    lora: bool = False
    sequence: int = 1  # parallel.sequence_parallel_size

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitioned over: every data replica's sequence shards."""
        return self.data * self.sequence

    def describe(self) -> str:
        grid = f"data x pipeline x tensor = {self.data} x {self.pipeline} x {self.tensor}"
        if self.sequence > 1:
            grid = f"data x sequence = {self.data} x {self.sequence}"
        return f"{self.backend} backend, ZeRO-{self.zero_stage}, {grid}"

    def to_json(self) -> str:
        """The text of `layout.json` (keys in field order)."""
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CheckpointManifest:
        return cls.from_record(json.loads(text))

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> CheckpointManifest:
        """A decoded `layout.json`; keys it does not know are ignored, and the ones a checkpoint
        saved before they were recorded lacks take what every run had then (`_OLDER_FILES`). Raises
        ValueError when one every layout.json has is missing."""
        names = [field.name for field in fields(cls)]
        missing = [name for name in names if not isinstance(record, Mapping) or name not in {*record, *_OLDER_FILES}]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        return cls(**{name: record[name] if name in record else _OLDER_FILES[name] for name in names})


# What a layout.json written before a key was recorded stands for: one optimizer group, an indexed
# corpus, and no tokenizer, global batch or training-set size to compare.
_OLDER_FILES: dict[str, Any] = {
    "optimizer_groups": 1,
    "tokenizer": None,
    "train_batch_size": None,
    "train_samples": None,
    "streamed": False,
    "lora": False,
    "sequence": 1,
}


def write_manifest(tag_dir: Path, manifest: CheckpointManifest) -> None:
    (tag_dir / MANIFEST_FILE).write_text(manifest.to_json())


def read_manifest(tag_dir: Path) -> CheckpointManifest | None:
    """The saving run's manifest; None for a checkpoint written before layouts were recorded."""
    path = tag_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        return CheckpointManifest.from_json(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"trainer.resume: {path} is damaged (not JSON: {error})") from None
    except ValueError as error:
        raise ValueError(f"trainer.resume: {path} is damaged (not a layout record: {error})") from None


_GROUPS = {
    1: "one optimizer group (weight decay on every parameter, or none)",
    2: "two optimizer groups (weight decay on the matrices, none on the biases and gains)",
}
_SETTINGS = {
    1: 'trainer.weight_decay_on "all", or optimizer.params.weight_decay 0 if it had none',
    2: 'trainer.weight_decay_on "matrices" and the same nonzero optimizer.params.weight_decay',
}

Check = Callable[[CheckpointManifest, CheckpointManifest, Path], None]


def _way_out(saved: CheckpointManifest) -> str:
    return (
        f"Resume it on its own layout ({saved.describe()}) with trainer.export on, then start this layout "
        f"from the export with model.init_from=<that run's output_dir>/export (weights only: the optimizer "
        f"starts afresh)."
    )


def _cannot_resume(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path, why: str) -> ReshapeError:
    return ReshapeError(
        f"trainer.resume: checkpoint {tag_dir} ({saved.describe()}) cannot be resumed on {current.describe()}: {why}"
    )


def vocabulary_splits(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    rows = saved.vocab_size
    if rows is not None and rows % current.tensor:
        raise ReshapeError(
            f"parallel.tensor_parallel_size: checkpoint {tag_dir} has {rows} vocabulary rows, which "
            f"{current.tensor} tensor-parallel shards cannot split, and a resumed model keeps its rows; "
            f"resume with a tensor-parallel size that divides {rows}"
        )


def same_vocabulary(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if saved.vocab_size != current.vocab_size:
        raise ReshapeError(
            f"model.vocab_size: checkpoint {tag_dir} has {saved.vocab_size} vocabulary rows, this run "
            f"{current.vocab_size}; set model.vocab_size to {saved.vocab_size}"
        )


def same_tokenizer(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # Checkpoints from before tokenizers were recorded say nothing; a synthetic-data run has none.
    if None not in (saved.tokenizer, current.tokenizer) and saved.tokenizer != current.tokenizer:
        raise ReshapeError(
            f"data.tokenizer: checkpoint {tag_dir} was trained on another tokenizer's ids ({saved.tokenizer}, "
            f"this run {current.tokenizer}): a char tokenizer numbers the characters of data.path, so a corpus "
            "with other characters gives each id another one. Resume with the data and tokenizer it was trained on"
        )


def same_streaming(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # Each rank reads its share of a stream from its own saved position; an indexed corpus has no
    # position to carry over.
    if saved.streamed != current.streamed:
        was, now = str(saved.streamed).lower(), str(current.streamed).lower()
        raise ReshapeError(
            f"data.streaming: checkpoint {tag_dir} was trained with data.streaming {was} and this run has "
            f"{now}; a stream's position and an indexed corpus's order do not carry over to each other. "
            f"Resume with data.streaming {was}"
        )


def stream_on_its_layout(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # Another layout would split the stream otherwise.
    shape = ("data", "pipeline", "tensor")
    if saved.streamed and [getattr(saved, key) for key in shape] != [getattr(current, key) for key in shape]:
        raise ReshapeError(
            f"data.streaming: checkpoint {tag_dir} was saved by {saved.data} data-parallel ranks ({saved.describe()}), "
            f"each rank with its own position in the stream, and this run is {current.describe()}; resume on the "
            "layout that saved it (a pipeline's middle stages read no data, so positions are kept rank by rank)"
        )


def _recorded_and_changed(saved: CheckpointManifest, current: CheckpointManifest, name: str) -> bool:
    """Checkpoints from before `name` was recorded say nothing about it."""
    was = getattr(saved, name)
    return was is not None and was != getattr(current, name)


def same_global_batch(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # The data order and the LR schedule count steps: on another global batch, step N would read
    # samples the checkpoint has trained on, or skip some.
    if _recorded_and_changed(saved, current, "train_batch_size"):
        batch = saved.train_batch_size
        raise ReshapeError(
            f"train_batch_size: checkpoint {tag_dir} trained on {batch} samples per step and this run on "
            f"{current.train_batch_size}; the data order and the LR schedule count steps, so the resumed run "
            f"would train on samples again or skip some. Keep train_batch_size {batch}: set it, with "
            'gradient_accumulation_steps "auto" to make it up on this number of ranks'
        )


def same_training_set(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # The order is drawn over the training set: another size (another data.path, seq_len, stride or
    # validation_fraction) reorders it, and with another split text the checkpoint trained on can be
    # validation now.
    if _recorded_and_changed(saved, current, "train_samples"):
        raise ReshapeError(
            f"data: checkpoint {tag_dir} trained on a training set of {saved.train_samples} samples, and this "
            f"run's holds {current.train_samples}; the data order is drawn over the training set, and with "
            "another split the checkpoint's training text could now be validation. Resume with the data "
            "section it was trained on (data.path, seq_len, stride, validation_fraction)"
        )


def same_optimizer_groups(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # Checkpoints from before the groups were recorded all had one (CheckpointManifest.from_record).
    if saved.optimizer_groups != current.optimizer_groups:
        raise ReshapeError(
            f"trainer.weight_decay_on: checkpoint {tag_dir} holds {_GROUPS[saved.optimizer_groups]}, and this "
            f"run {_GROUPS[current.optimizer_groups]}; optimizer states load group by group. Resume with the "
            f"grouping it was saved with ({_SETTINGS[saved.optimizer_groups]}), or: {_way_out(saved)}"
        )


def same_adapters(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    # A LoRA checkpoint holds the adapters and their optimizer states alone; its base is model.init_from's.
    if saved.lora != current.lora:
        held = "model.lora's adapters alone" if saved.lora else "every weight of the model"
        trains = "adapters (model.lora)" if current.lora else "every weight (no model.lora)"
        raise ReshapeError(
            f"model.lora: checkpoint {tag_dir} holds {held}, and this run trains {trains}; resume with the "
            "model.lora section it was saved with"
        )


def converts(saved: CheckpointManifest, current: CheckpointManifest) -> bool:
    """The decision: whether a resume of `saved` on `current` goes through the universal form."""
    # torch.distributed.checkpoint reshards on load: DDP's whole tensors and FSDP's row pieces are
    # read into whatever this run holds, at any data-parallel size.
    if saved.backend == current.backend == "accelerate":
        return False
    same_partitions = all(getattr(saved, key) == getattr(current, key) for key in ("pipeline", "tensor", "zero_stage"))
    # ZeRO-0 keeps whole optimizer states, which load at any data-parallel size; ZeRO's partitions load
    # where as many ranks hold them, whichever split the sequences. Anything else goes through the
    # universal form, which holds every parameter whole: DeepSpeed cuts it into any partitions, torch
    # into any accelerate wrapper's pieces.
    return not (
        saved.backend == current.backend == "deepspeed"
        and same_partitions
        and (saved.zero_ranks == current.zero_ranks or saved.zero_stage == 0)
    )


def _on_conversion(check: Check) -> Check:
    """A check of what the conversion needs: it applies only where `converts` says one is made."""

    @functools.wraps(check)
    def checked(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
        if converts(saved, current):
            check(saved, current, tag_dir)

    return checked


@_on_conversion
def tensor_shards_recorded(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if saved.backend == "accelerate" and current.tensor > 1:
        raise _cannot_resume(
            saved,
            current,
            tag_dir,
            "DeepSpeed cuts a universal checkpoint into tensor-parallel shards by what its converter recorded "
            "of the saving run's shards, and the accelerate backend has none. Resume it under DeepSpeed with "
            f"parallel.tensor_parallel_size 1 and save, then reshape that checkpoint, or: {_way_out(saved)}",
        )


@_on_conversion
def universal_into_zero_partitions(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if current.backend == "deepspeed" and current.zero_stage == 0:
        raise _cannot_resume(
            saved,
            current,
            tag_dir,
            "DeepSpeed's universal checkpoint loads into ZeRO-partitioned optimizer states only, and "
            "ZeRO-0 keeps none. Use zero_optimization.stage 1 (the same arithmetic and memory as 0 on one "
            f"rank) under DeepSpeed, or: {_way_out(saved)}",
        )


@_on_conversion
def zero0_optimizer_order_recorded(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if (
        saved.backend == "deepspeed"
        and saved.zero_stage == 0
        and not (tag_dir / NAMES_FOLDER / OPTIMIZER_ORDER).is_file()
    ):
        raise _cannot_resume(
            saved,
            current,
            tag_dir,
            "a ZeRO-0 checkpoint converts when it holds torch's own optimizer state (fp32, without tensor or "
            "pipeline parallelism) and the save recorded its optimizer order (names/optimizer_order.json). This "
            "one has no such record: it holds DeepSpeed's bf16 or fp16 optimizer state or model-parallel "
            f"pieces, which no converter reads, or it was saved before the order was recorded. {_way_out(saved)}",
        )


@_on_conversion
def accelerate_names_recorded(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if saved.backend == "accelerate" and not (tag_dir / NAMES_FOLDER).is_dir():
        raise ReshapeError(
            f"trainer.resume: checkpoint {tag_dir} was saved by the accelerate backend before it recorded its "
            f"parameter names (names/), which DeepSpeed needs to find each parameter. Resume it under the "
            f"accelerate backend and save again, or: {_way_out(saved)}"
        )


@_on_conversion
def adapters_on_their_layout(saved: CheckpointManifest, current: CheckpointManifest, tag_dir: Path) -> None:
    if saved.lora:
        raise _cannot_resume(
            saved,
            current,
            tag_dir,
            "a LoRA checkpoint holds the adapters and their optimizer states alone, and the universal form a "
            "reshape goes through holds every parameter of the model. Resume it on its own layout "
            f"({saved.describe()}); or export it merged (trainer.export_merge_lora) and start this layout from "
            "that export with model.init_from and fresh adapters",
        )


# Run in order: the first to fail names its setting and the way out.
CHECKS: tuple[Check, ...] = (
    vocabulary_splits,
    same_vocabulary,
    same_tokenizer,
    same_streaming,
    stream_on_its_layout,
    same_global_batch,
    same_training_set,
    same_optimizer_groups,
    same_adapters,
    adapters_on_their_layout,
    tensor_shards_recorded,
    universal_into_zero_partitions,
    zero0_optimizer_order_recorded,
    accelerate_names_recorded,
)


def needs_conversion(saved: CheckpointManifest | None, current: CheckpointManifest, tag_dir: Path) -> bool:
    """Whether resuming `tag_dir` (saved as `saved`) on `current` goes through a universal
    checkpoint; raises ReshapeError, naming both layouts and the way out, when it cannot."""
    if saved is None:
        return False
    for check in CHECKS:
        check(saved, current, tag_dir)
    return converts(saved, current)
