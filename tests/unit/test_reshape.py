"""Which resumes convert a checkpoint to another layout and which are refused (naming the way out),
decided in-process from the saved and the current layout, and saved buffers read by the unsplit
model's names. The resumes on another layout, launched for real, are in
tests/launched/test_reshape_launched.py."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from engine.checkpoints.reshape import CheckpointManifest, ReshapeError, needs_conversion
from engine.checkpoints.universal import save_names, saved_buffers


def layout(**changes) -> CheckpointManifest:
    record = CheckpointManifest(
        "deepspeed",
        data=2,
        pipeline=1,
        tensor=1,
        zero_stage=2,
        vocab_size=64,
        optimizer_groups=2,
        tokenizer="byte",
        train_batch_size=8,
        train_samples=960,
    )
    return replace(record, **changes)


@pytest.mark.parametrize(
    "saved,current,converts",
    [
        (layout(), layout(), False),
        (layout(zero_stage=0), layout(zero_stage=0, data=4), False),
        (layout(), layout(data=1), True),
        (layout(), layout(zero_stage=1), True),
        (layout(), layout(zero_stage=3, data=1), True),
        (layout(zero_stage=3), layout(zero_stage=3, data=1), True),
        (layout(zero_stage=3), layout(zero_stage=2, data=1), True),
        (layout(tensor=2, data=1, zero_stage=1), layout(data=2, zero_stage=1), True),
        (layout(optimizer_groups=1), layout(optimizer_groups=1), False),
        # Checkpoints from before tokenizers were recorded, and synthetic tokens, have none to compare.
        (
            CheckpointManifest.from_record(
                {key: value for key, value in asdict(layout()).items() if key != "tokenizer"}
            ),
            layout(),
            False,
        ),
        (layout(tokenizer=None), layout(), False),
        # Nor did they record the global batch, or the training set's size.
        (
            CheckpointManifest.from_record(
                {key: value for key, value in asdict(layout()).items() if key != "train_batch_size"}
            ),
            layout(data=1),
            True,
        ),
        (
            CheckpointManifest.from_record(
                {key: value for key, value in asdict(layout()).items() if key != "train_samples"}
            ),
            layout(train_samples=9),
            False,
        ),
        # torch.distributed.checkpoint reshards any accelerate checkpoint on load.
        (layout(backend="accelerate", zero_stage=3), layout(backend="accelerate", zero_stage=0, data=1), False),
        # The accelerate backend reads a DeepSpeed checkpoint through its universal form, even on the same layout.
        (layout(), layout(backend="accelerate"), True),
        (layout(zero_stage=1, pipeline=2, tensor=2, data=1), layout(backend="accelerate", zero_stage=0), True),
        # DeepSpeed reads an accelerate checkpoint through a universal form made from it.
        (layout(backend="accelerate"), layout(), True),
        (layout(backend="accelerate", zero_stage=3), layout(pipeline=2, data=1, zero_stage=1), True),
        # An fp32 ZeRO-0 checkpoint converts from torch's optimizer state, into anything but ZeRO-0.
        (layout(zero_stage=0), layout(zero_stage=2, data=1), True),
        (layout(zero_stage=0), layout(backend="accelerate", zero_stage=3), True),
    ],
)
def test_which_resumes_convert(saved: CheckpointManifest, current: CheckpointManifest, converts: bool, tmp_path: Path):
    (tmp_path / "names").mkdir()  # every checkpoint records its parameter names
    (tmp_path / "names" / "optimizer_order.json").write_text("[]")  # and fp32 ZeRO-0 its optimizer order
    assert needs_conversion(saved, current, tmp_path) is converts


@pytest.mark.parametrize(
    "saved,current,message",
    [
        (layout(zero_stage=0), layout(zero_stage=0, tensor=2), "ZeRO-0 keeps none"),
        (layout(), layout(zero_stage=0), "ZeRO-0 keeps none"),
        (layout(backend="accelerate"), layout(tensor=2, data=1, zero_stage=1), "tensor_parallel_size 1"),
        (layout(backend="accelerate"), layout(zero_stage=0), "ZeRO-0 keeps none"),
        (layout(backend="accelerate"), layout(), "before it recorded its parameter names"),
        # Saved without its optimizer order: bf16 or fp16, or tensor- or pipeline-parallel.
        (layout(zero_stage=0), layout(backend="accelerate", zero_stage=0), "which no converter reads"),
        (layout(zero_stage=0), layout(zero_stage=2, data=1), "which no converter reads"),
        (layout(), layout(vocab_size=60), "model.vocab_size: checkpoint"),
        (layout(tokenizer="char:0123"), layout(tokenizer="char:4567"), "data.tokenizer: checkpoint .* another"),
        (layout(), layout(data=1, train_batch_size=4), "train_batch_size: checkpoint .* 8 samples per step"),
        (layout(), layout(train_samples=860), "data: checkpoint .* 960 samples, and this run's holds 860"),
        # "auto" pads 59 rows to 60 for two shards; asking for 59 would fail on the split instead.
        (layout(vocab_size=59), layout(vocab_size=60, tensor=2, data=1, zero_stage=1), "cannot split"),
        (layout(), layout(optimizer_groups=1), 'weight_decay_on: .* two optimizer groups .* "matrices"'),
        (layout(optimizer_groups=1), layout(data=1), 'one optimizer group .*weight_decay_on "all"'),
        # Saved before the layout recorded the groups, when every run had one.
        (
            CheckpointManifest.from_record(
                {key: value for key, value in asdict(layout()).items() if key != "optimizer_groups"}
            ),
            layout(),
            "one optimizer group",
        ),
    ],
)
def test_impossible_reshapes_name_the_way_out(
    saved: CheckpointManifest, current: CheckpointManifest, message: str, tmp_path: Path
):
    with pytest.raises(ReshapeError, match=message) as refusal:
        needs_conversion(saved, current, tmp_path)
    if not any(word in message for word in ("vocab", "split", "tokenizer", "train_batch_size", "data:")):
        assert "model.init_from" in str(refusal.value)


def test_saved_buffers_are_read_by_the_unsplit_model_names(tmp_path: Path):
    """A pipeline layer's file holds its buffers under the layer's own names; the names record
    maps the pipeline module's (layer index first) to the whole model's."""
    torch.save({"module": None}, tmp_path / "mp_rank_00_model_states.pt")
    torch.save({"bn.running_mean": torch.ones(2)}, tmp_path / "layer_03-model_00-model_states.pt")
    save_names(tmp_path, 0, {"3.bn.running_mean": "stages.1.bn.running_mean"})
    assert saved_buffers(tmp_path, ["stages.1.bn.running_mean"])["stages.1.bn.running_mean"].tolist() == [1.0, 1.0]
    with pytest.raises(KeyError, match=f"checkpoint {tmp_path} holds no saved buffer stages.1.bn.running_var"):
        saved_buffers(tmp_path, ["stages.1.bn.running_mean", "stages.1.bn.running_var"])
