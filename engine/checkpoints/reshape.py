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

import json
from pathlib import Path
from typing import Any

LAYOUT_FILE = "layout.json"
NAMES_FOLDER = "names"  # every rank's parameter and buffer names (engine/checkpoints/universal.py)
# Under NAMES_FOLDER: an fp32 ZeRO-0 checkpoint's optimizer parameters by position (from_torch.py).
OPTIMIZER_ORDER = "optimizer_order.json"


class ReshapeError(ValueError):
    """A checkpoint that cannot be resumed on this run's layout (with what to do instead)."""


def layout_record(
    backend: str,
    data: int,
    pipeline: int,
    tensor: int,
    zero_stage: int,
    vocab_size: int | None,
    optimizer_groups: int,
    tokenizer: str | None,
    train_batch_size: int,
    train_samples: int | None,
    streamed: bool = False,
) -> dict[str, Any]:
    """What a checkpoint must know about the run that saved it to be resumed elsewhere.
    `tokenizer` is the tokenizer's fingerprint (text runs only); `train_samples` the size of the
    training set the data order was drawn over (None for a streamed corpus, read in its own order
    by each data-parallel rank, `streamed`)."""
    return {
        "backend": backend,
        "data": data,
        "pipeline": pipeline,
        "tensor": tensor,
        "zero_stage": zero_stage,
        "vocab_size": vocab_size,
        "optimizer_groups": optimizer_groups,
        "tokenizer": tokenizer,
        "train_batch_size": train_batch_size,
        "train_samples": train_samples,
        "streamed": streamed,
    }


def write_layout(tag_dir: Path, record: dict[str, Any]) -> None:
    (tag_dir / LAYOUT_FILE).write_text(json.dumps(record, indent=1) + "\n")


def read_layout(tag_dir: Path) -> dict[str, Any] | None:
    """The saving run's layout; None for a checkpoint written before layouts were recorded."""
    path = tag_dir / LAYOUT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"trainer.resume: {path} is damaged (not JSON: {error})") from None


_GROUPS = {
    1: "one optimizer group (weight decay on every parameter, or none)",
    2: "two optimizer groups (weight decay on the matrices, none on the biases and gains)",
}
_SETTINGS = {
    1: 'trainer.weight_decay_on "all", or optimizer.params.weight_decay 0 if it had none',
    2: 'trainer.weight_decay_on "matrices" and the same nonzero optimizer.params.weight_decay',
}


def describe(record: dict[str, Any]) -> str:
    return (
        f"{record['backend']} backend, ZeRO-{record['zero_stage']}, data x pipeline x tensor = "
        f"{record['data']} x {record['pipeline']} x {record['tensor']}"
    )


def needs_conversion(saved: dict[str, Any] | None, current: dict[str, Any], tag_dir: Path) -> bool:
    """Whether resuming `tag_dir` (saved as `saved`) on `current` goes through a universal
    checkpoint; raises ReshapeError, naming both layouts and the way out, when it cannot."""
    if saved is None:
        return False
    way_out = (
        f"Resume it on its own layout ({describe(saved)}) with trainer.export on, then start this layout "
        f"from the export with model.init_from=<that run's output_dir>/export (weights only: the optimizer "
        f"starts afresh)."
    )
    rows = saved["vocab_size"]
    if rows is not None and rows % current["tensor"]:
        raise ReshapeError(
            f"parallel.tensor_parallel_size: checkpoint {tag_dir} has {rows} vocabulary rows, which "
            f"{current['tensor']} tensor-parallel shards cannot split, and a resumed model keeps its rows; "
            f"resume with a tensor-parallel size that divides {rows}"
        )
    if saved["vocab_size"] != current["vocab_size"]:
        raise ReshapeError(
            f"model.vocab_size: checkpoint {tag_dir} has {saved['vocab_size']} vocabulary rows, this run "
            f"{current['vocab_size']}; set model.vocab_size to {saved['vocab_size']}"
        )
    # Checkpoints from before tokenizers were recorded say nothing; a synthetic-data run has none.
    if None not in (saved.get("tokenizer"), current["tokenizer"]) and saved["tokenizer"] != current["tokenizer"]:
        raise ReshapeError(
            f"data.tokenizer: checkpoint {tag_dir} was trained on another tokenizer's ids ({saved['tokenizer']}, "
            f"this run {current['tokenizer']}): a char tokenizer numbers the characters of data.path, so a corpus "
            "with other characters gives each id another one. Resume with the data and tokenizer it was trained on"
        )
    # Each rank reads its share of a stream from its own saved position; another layout would split the
    # stream otherwise, and an indexed corpus has no position to carry over.
    streamed = saved.get("streamed", False)
    if streamed != current["streamed"]:
        raise ReshapeError(
            f"data.streaming: checkpoint {tag_dir} was trained with data.streaming {str(streamed).lower()} and "
            f"this run has {str(current['streamed']).lower()}; a stream's position and an indexed corpus's order "
            f"do not carry over to each other. Resume with data.streaming {str(streamed).lower()}"
        )
    shape = ("data", "pipeline", "tensor")
    if streamed and [saved[key] for key in shape] != [current[key] for key in shape]:
        raise ReshapeError(
            f"data.streaming: checkpoint {tag_dir} was saved by {saved['data']} data-parallel ranks "
            f"({describe(saved)}), each rank with its own position in the stream, and this run is "
            f"{describe(current)}; resume on the "
            "layout that saved it (a pipeline's middle stages read no data, so positions are kept rank by rank)"
        )
    # The data order and the LR schedule count steps: on another global batch, step N would read
    # samples the checkpoint has trained on, or skip some. Checkpoints from before it was recorded say nothing.
    batch = saved.get("train_batch_size")
    if batch is not None and batch != current["train_batch_size"]:
        raise ReshapeError(
            f"train_batch_size: checkpoint {tag_dir} trained on {batch} samples per step and this run on "
            f"{current['train_batch_size']}; the data order and the LR schedule count steps, so the resumed run "
            f"would train on samples again or skip some. Keep train_batch_size {batch}: set it, with "
            'gradient_accumulation_steps "auto" to make it up on this number of ranks'
        )
    # The order is drawn over the training set: another size (another data.path, seq_len, stride or
    # validation_fraction) reorders it, and with another split text the checkpoint trained on can be
    # validation now. Checkpoints from before it was recorded say nothing.
    samples = saved.get("train_samples")
    if samples is not None and samples != current["train_samples"]:
        raise ReshapeError(
            f"data: checkpoint {tag_dir} trained on a training set of {samples} samples, and this run's holds "
            f"{current['train_samples']}; the data order is drawn over the training set, and with another split "
            "the checkpoint's training text could now be validation. Resume with the data section it was trained "
            "on (data.path, seq_len, stride, validation_fraction)"
        )
    # Checkpoints from before the groups were recorded all had one.
    saved_groups = saved.get("optimizer_groups", 1)
    if saved_groups != current["optimizer_groups"]:
        raise ReshapeError(
            f"trainer.weight_decay_on: checkpoint {tag_dir} holds {_GROUPS[saved_groups]}, and this run "
            f"{_GROUPS[current['optimizer_groups']]}; optimizer states load group by group. Resume with the "
            f"grouping it was saved with ({_SETTINGS[saved_groups]}), or: {way_out}"
        )
    # torch.distributed.checkpoint reshards on load: DDP's whole tensors and FSDP's row pieces are
    # read into whatever this run holds, at any data-parallel size.
    if saved["backend"] == "accelerate" and current["backend"] == "accelerate":
        return False
    if saved["backend"] == "accelerate" and current["tensor"] > 1:
        raise ReshapeError(
            f"trainer.resume: checkpoint {tag_dir} ({describe(saved)}) cannot be resumed on {describe(current)}: "
            "DeepSpeed cuts a universal checkpoint into tensor-parallel shards by what its converter recorded "
            "of the saving run's shards, and the accelerate backend has none. Resume it under DeepSpeed with "
            f"parallel.tensor_parallel_size 1 and save, then reshape that checkpoint, or: {way_out}"
        )
    same_partitions = all(saved[key] == current[key] for key in ("pipeline", "tensor", "zero_stage"))
    # ZeRO-0 keeps whole optimizer states, which load at any data-parallel size.
    if (
        saved["backend"] == current["backend"] == "deepspeed"
        and same_partitions
        and (saved["data"] == current["data"] or saved["zero_stage"] == 0)
    ):
        return False
    # Anything else goes through the universal form, which holds every parameter whole: DeepSpeed
    # cuts it into any partitions, torch into any accelerate wrapper's pieces.
    if current["backend"] == "deepspeed" and current["zero_stage"] == 0:
        raise ReshapeError(
            f"trainer.resume: checkpoint {tag_dir} ({describe(saved)}) cannot be resumed on {describe(current)}: "
            "DeepSpeed's universal checkpoint loads into ZeRO-partitioned optimizer states only, and "
            "ZeRO-0 keeps none. Use zero_optimization.stage 1 (the same arithmetic and memory as 0 on one "
            f"rank) under DeepSpeed, or: {way_out}"
        )
    if (
        saved["backend"] == "deepspeed"
        and saved["zero_stage"] == 0
        and not (tag_dir / NAMES_FOLDER / OPTIMIZER_ORDER).is_file()
    ):
        raise ReshapeError(
            f"trainer.resume: checkpoint {tag_dir} ({describe(saved)}) cannot be resumed on {describe(current)}: "
            "a ZeRO-0 checkpoint converts when it holds torch's own optimizer state (fp32, without tensor or "
            "pipeline parallelism) and the save recorded its optimizer order (names/optimizer_order.json). This "
            "one has no such record: it holds DeepSpeed's bf16 or fp16 optimizer state or model-parallel "
            f"pieces, which no converter reads, or it was saved before the order was recorded. {way_out}"
        )
    if saved["backend"] == "accelerate" and not (tag_dir / NAMES_FOLDER).is_dir():
        raise ReshapeError(
            f"trainer.resume: checkpoint {tag_dir} was saved by the accelerate backend before it recorded its "
            f"parameter names (names/), which DeepSpeed needs to find each parameter. Resume it under the "
            f"accelerate backend and save again, or: {way_out}"
        )
    return True
