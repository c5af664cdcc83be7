"""End-to-end behaviour of a run: accumulation, the export, what a run writes, and
bad input stopping a run before any process group starts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from PIL import Image
from safetensors.torch import load_file
from transformers import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from data import load_saved_tokenizer
from models import get_family
from models.gpt import flops_per_token as gpt_flops_per_token
from tests.support.compare import (
    CLIPPED_WEIGHT_TOLERANCE,
    LOSS_TOLERANCE,
    UNCLIPPED_WEIGHT_TOLERANCE,
    assert_grad_norms_match,
    assert_weights_match,
    max_loss_difference,
)
from tests.support.launch import ROOT, launch, read_run, run_single
from tests.support.monitor import MONITORS, assert_monitor_holds, csv_values, monitor_dir
from tests.support.reference import reference_run
from tests.support.shared_runs import Trained

GPT = "configs/tiny_gpt.json"
RESNET = "configs/tiny_resnet.json"
SCHEDULED = {
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 3, "warmup_type": "linear"}},
    "zero_optimization.stage": 3,
    "trainer.max_steps": 10,
    "trainer.save_interval": 5,
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """Ten steps of ZeRO-3 with a warm-up/cosine schedule, checkpointed at step 5 and 10, with
    TensorBoard and CSV monitors on, and the plots drawn."""
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    launch(GPT, {**SCHEDULED, **MONITORS, "trainer.plots": True}, output_dir)
    return output_dir


@pytest.mark.launch
def test_accumulation_2_x_micro_2_equals_micro_4(tmp_path: Path):
    """Two micro-batches of 2 per step on each of 2 ranks train what one process trains on the
    global batch of 8, under a warm-up/cosine schedule: the losses, and, since Adam hides a
    gradient wrongly scaled by the accumulation count, the gradient norms and the weights too."""
    schedule = {"scheduler": SCHEDULED["scheduler"], "gradient_clipping": 0.0, "zero_optimization.stage": 2}
    run = launch(GPT, {**schedule, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, tmp_path)
    reference = reference_run(GPT, {**schedule, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    # Two means of 2 against one of 4 round differently (measured: one bias element 1.1e-7 off), and
    # Adam enlarges that for elements whose gradient is near eps, by at most a learning-rate step.
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)


@pytest.mark.launch
def test_export_loads_with_from_pretrained_and_gives_the_engine_logits(uninterrupted: Path):
    resolved = json.loads((uninterrupted / "resolved_config.json").read_text())
    engine_model = get_family("gpt").build(resolved["model"])
    engine_state = get_fp32_state_dict_from_zero_checkpoint(str(uninterrupted / "checkpoints"), tag="step00000010")
    engine_model.load_state_dict(engine_state, strict=False)
    exported = GPT2LMHeadModel.from_pretrained(uninterrupted / "export")
    tokens = torch.randint(0, resolved["model"]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens).logits, engine_model.eval()(tokens).logits, rtol=0, atol=0)
    tokenizer = load_saved_tokenizer(uninterrupted / "export")
    assert tokenizer.vocab_size == resolved["model"]["vocab_size"]
    assert tokenizer.decode(tokenizer.encode("Shall I compare thee")) == "Shall I compare thee"


@pytest.mark.launch
def test_run_writes_metrics_and_resolved_config(uninterrupted: Path):
    records = read_run(uninterrupted).records
    assert [r["step"] for r in records] == list(range(1, 11))
    for record in records:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= record.keys()
        assert record["tokens_per_s"] > 0
    assert {"eval_loss", "eval_perplexity"} <= records[-1].keys()
    assert records[-1]["eval_perplexity"] == pytest.approx(torch.tensor(records[-1]["eval_loss"]).exp().item())
    assert records[0]["lr"] < records[2]["lr"]  # warm-up
    resolved = (uninterrupted / "resolved_config.json").read_text()
    assert '"auto"' not in resolved
    config = json.loads(resolved)
    assert config["zero_optimization"]["stage"] == 3
    # Achieved model FLOP/s per device, 6N + attention per token; no MFU claimed without a known peak.
    model = config["model"]
    per_token = gpt_flops_per_token(model["n_layer"], model["n_embd"], model["vocab_size"], config["data"]["seq_len"])
    for record in records:
        assert record["tflops_per_device"] == pytest.approx(per_token * record["tokens_per_s"] / 2 / 1e12)
        assert "mfu" not in record


@pytest.mark.launch
def test_run_draws_its_plots_at_the_end(uninterrupted: Path):
    plots = uninterrupted / "plots"
    expected = {"loss", "eval", "lr", "grad_norm", "throughput", "step_time", "memory"}
    assert {path.stem for path in plots.glob("*.png")} == expected
    for name in expected:
        with Image.open(plots / f"{name}.png") as image:
            assert image.width > 100 and image.height > 100
            grey_levels = sum(1 for count in image.convert("L").histogram() if count)
            assert grey_levels > 2  # something is drawn, not a blank canvas
    for record in read_run(uninterrupted).records:
        assert record["grad_norm"] > 0
        assert {"time_data_s", "time_forward_s", "time_backward_s", "time_step_s"} <= record.keys()
        assert [rank["parameter_bytes"] > 0 for rank in record["ranks"]] == [True, True]


@pytest.mark.launch
def test_run_writes_its_metrics_through_deepspeeds_monitor(uninterrupted: Path):
    losses = assert_monitor_holds(uninterrupted, "loss")
    # DeepSpeed's own events share the directory: its learning rate after every optimizer step.
    assert csv_values(monitor_dir(uninterrupted), "Train/Samples/lr").keys() == losses.keys()


def test_single_process_without_launcher_trains(tmp_path: Path):
    """`python engine/main.py` alone makes a world of one, logs to its rank file as to the terminal,
    and trains the reference's numbers."""
    result = run_single(GPT, {"trainer.max_steps": 3, "trainer.sample_tokens": 20}, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sample:" in result.stdout + result.stderr
    assert "step=1 loss=" in result.stdout
    assert "step=1 loss=" in (tmp_path / "logs" / "rank0.log").read_text()
    run = read_run(tmp_path)
    reference = reference_run(GPT, {"trainer.max_steps": 3}, world_size=1)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ({"data.path": "EMPTY"}, "is empty"),
        ({"trainer.resume": True}, "holds no checkpoint to resume from"),
        ({"trainer.resume": "STEP5", "trainer.max_steps": 3}, "trainer.max_steps: 3 is below step 5 of checkpoint"),
        ({"model.vocab_size": 10}, "model.vocab_size: 10 is smaller than the tokenizer's"),
        ({"train_micro_batch_size_per_gpu": 4096}, "samples cannot fill one global batch of 4096"),
        ({"zero_optimization.stage": 5}, 'zero_optimization.stage: expected an integer >= 0 <= 3 or "auto", got 5'),
        ({"model.init_from": "EMPTY"}, "empty_checkpoint is not a transformers checkpoint"),
    ],
)
def test_bad_input_stops_before_any_process_group(overrides: dict, expected: str, tmp_path: Path):
    if overrides.get("data.path") == "EMPTY":
        empty = tmp_path / "empty.txt"
        empty.touch()
        overrides = {"data.path": str(empty)}
    if overrides.get("trainer.resume") == "STEP5":
        (tmp_path / "checkpoints" / "step00000005").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step00000005" / "layout.json").write_text("{}")
        overrides = {**overrides, "trainer.resume": str(tmp_path / "checkpoints" / "step00000005")}
    if overrides.get("model.init_from") == "EMPTY":
        (tmp_path / "empty_checkpoint").mkdir()
        overrides = {"model.init_from": str(tmp_path / "empty_checkpoint")}
    result = run_single(GPT, overrides, tmp_path / "run")
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert "init_distributed" not in result.stdout + result.stderr


def test_resnet_trains_at_cifars_32_pixels(tmp_path: Path):
    """At 32 pixels ResNet's last feature map is 1x1: what counts the model's FLOPs and plans its
    memory must not run training-mode BatchNorm on a single image."""
    overrides = {"data.image_size": 32, "train_micro_batch_size_per_gpu": 2, "trainer.max_steps": 2}
    result = run_single("configs/tiny_resnet.json", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [record["step"] for record in read_run(tmp_path).records] == [1, 2]
    plan = subprocess.run(
        [sys.executable, "-m", "engine", "plan", "configs/tiny_resnet.json", "--world-size", "1"]
        + [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plan.returncode == 0, plan.stderr[-3000:]


def test_a_classifier_smaller_than_the_image_classes_stops_before_any_process_group(tmp_path: Path):
    for label in ("cat", "dog", "owl"):
        (tmp_path / "images" / label).mkdir(parents=True)
        for index in range(4):
            Image.new("RGB", (8, 8), (index, 0, 0)).save(tmp_path / "images" / label / f"{index}.png")
    overrides = {
        "data.type": "image",
        "data.path": str(tmp_path / "images"),
        "data.validation_fraction": 0.25,
        "model.num_classes": 2,
    }
    result = run_single("configs/tiny_resnet.json", overrides, tmp_path / "run")
    assert result.returncode == 2
    assert "model.num_classes: 2 is fewer than the 3 classes of the data" in result.stderr
    assert "Traceback" not in result.stderr
    assert "init_distributed" not in result.stdout + result.stderr


@pytest.mark.launch
@pytest.mark.parametrize(
    "launcher,command,shared",
    [
        ("deepspeed", "+ deepspeed --num_gpus 2", "resnet_zero2"),
        ("accelerate", "+ accelerate launch --num_processes 2", "resnet_fsdp"),
    ],
)
def test_launch_script_runs_two_cpu_processes(
    launcher: str, command: str, shared: str, trained: Callable[[str], Trained]
):
    """launch.sh picks the launcher, and the backend follows it: both train the single-process
    reference's numbers (unclipped ResNet, which every mode matches bit for bit: test_parity.py).
    The ResNet runs of tests/support/shared_runs.py (ZeRO-2, FSDP), which launch.sh starts."""
    source = trained(shared)
    assert source.spec.launch_script and source.spec.accelerate == (launcher == "accelerate")
    run, overrides = source.run, source.overrides
    assert command in run.stdout
    assert "on 2 rank(s)" in run.stdout
    backend = "deepspeed" if launcher == "deepspeed" else "accelerate"
    assert json.loads((run.output_dir / "resolved_config.json").read_text())["trainer"]["backend"] == backend
    reference = reference_run(RESNET, {**overrides, "trainer.backend": backend}, world_size=2)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_weights_match(run.exported_state_dict(), reference.model, UNCLIPPED_WEIGHT_TOLERANCE)


def test_bf16_zero0_resnet_exports_the_fp32_master_weights(tmp_path: Path):
    """bf16 on CPU is allowed (never chosen by "auto"): BatchNorm statistics follow the training
    dtype, and the export holds the fp32 masters, not upcast bf16 weights."""
    overrides = {"bf16.enabled": True, "zero_optimization.stage": 0, "trainer.max_steps": 2}
    overrides["trainer.single_rank_fast_path"] = False  # bf16 as written, not torch_autocast
    result = run_single("configs/tiny_resnet.json", overrides, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    exported = read_run(tmp_path).exported_state_dict()
    weights = [tensor for name, tensor in exported.items() if name.endswith("convolution.weight")]
    assert all(tensor.dtype == torch.float32 for tensor in weights)
    assert any((tensor.bfloat16().float() != tensor).any() for tensor in weights)


@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 3], ids=["zero0", "zero3"])
def test_an_init_from_checkpoint_trained_zero_steps_exports_unchanged(stage: int, tmp_path: Path):
    """The round trip with nothing in between: a Llama checkpoint transformers wrote, started from
    with `model.init_from` and `trainer.max_steps: 0`, is saved through DeepSpeed's checkpoint
    (ZeRO-3: partitioned and gathered again) and exported tensor for tensor as it was read."""
    torch.manual_seed(0)
    source = tmp_path / "hf"
    architecture = dict(get_family("llama").presets["tiny"], vocab_size=96, max_position_embeddings=32)
    LlamaForCausalLM(LlamaConfig(**architecture)).save_pretrained(source)
    overrides = {
        "model.init_from": source,
        "model.vocab_size": 96,
        "trainer.max_steps": 0,
        "zero_optimization.stage": stage,
        "trainer.single_rank_fast_path": False,  # the stage as written: ZeRO-3's partitioned save
    }
    result = run_single("configs/llama_tiny.json", overrides, tmp_path / "run")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    exported, written = (
        load_file(tmp_path / "run" / "export" / "model.safetensors"),
        load_file(source / "model.safetensors"),
    )
    assert exported.keys() == written.keys()
    for name, tensor in written.items():
        assert torch.equal(exported[name], tensor), name
