"""Pipeline stages, tensor-parallel shards and both together with data parallelism, launched
for real under the deepspeed launcher, train the same numbers as one plain PyTorch process on
the same global batch (fp32, CPU, gloo). Resumes, on the same layout and on others, are in
test_reshape.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.compare import (
    LOSS_TOLERANCE,
    assert_eval_matches,
    assert_grad_norms_match,
    assert_weights_match,
    max_loss_difference,
)
from tests.support.launch import ROOT, launch
from tests.support.memory import assert_plan_matches_measured
from tests.support.reference import reference_run
from tests.support.shared_runs import SHARED_RUNS, Trained

GPT, RESNET, LLAMA = "configs/tiny_gpt.json", "configs/tiny_resnet.json", "configs/llama_tiny.json"
PP2 = {"parallel.pipeline_parallel_size": 2}
TP2 = {"parallel.tensor_parallel_size": 2}
# The same global batch in two micro-batches a step: the pipeline's 1F1B schedule then interleaves
# forwards and backwards, and the stages accumulate.
TWO_MICRO_BATCHES = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
# Pipeline stages run the reference's own modules in the reference's order; measured: bit-identical
# without clipping. With it, the stages sum the gradient norm in another order, and the clip
# coefficient's last bit moves the odd element whose gradient is near eps: 1.05e-6 measured (one
# GPT-2 bias element), where one step of decay on a gain would be lr x weight_decay = 1e-4.
# Tensor parallelism splits each matmul, so sums are reordered; Adam turns the last-bit
# differences into visible steps for elements whose gradient is near eps, at most about lr per
# step (docs/design/models.md, "The tiny ResNet of the tests").
PIPELINE_WEIGHT_TOLERANCE = 1e-5
TENSOR_WEIGHT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Layout:
    name: str
    config: str
    nproc: int
    overrides: dict
    # A run the resume and reshape tests continue too (tests/support/shared_runs.py), trained once for
    # six steps under a warm-up schedule: its layout is the shared run's.
    shared: str | None = None

    @property
    def hf_tokenizer(self) -> bool:
        """Trained on tests/conftest.py's byte-level BPE, exported beside the weights."""
        return self.shared is not None and SHARED_RUNS[self.shared].hf_tokenizer

    @property
    def weight_tolerance(self) -> float:
        tensor = self.overrides.get("parallel.tensor_parallel_size", 1) > 1
        return TENSOR_WEIGHT_TOLERANCE if tensor else PIPELINE_WEIGHT_TOLERANCE


# The integration matrix: each row is launched exactly as a user would launch it.
LAYOUTS = [
    Layout("pp2_gpt_tied", GPT, 2, PP2),
    Layout("pp2_resnet", RESNET, 2, SHARED_RUNS["resnet_pp2"].layout, shared="resnet_pp2"),
    # The last stage's tied head called by the tiled loss piece by piece, under the stages' checkpointing.
    Layout(
        "pp2_partition_by_type_checkpointed_2_micro_batches_tiled_loss",
        GPT,
        2,
        {
            **PP2,
            **TWO_MICRO_BATCHES,
            "parallel.pipeline_partition_method": "type",
            "parallel.pipeline_activation_checkpoint_interval": 1,
            "model.loss": "tiled",
        },
    ),
    # The tied head split by vocabulary, called by the tiled loss piece by piece (models/tiling.py).
    Layout("tp2", GPT, 2, {**TP2, "model.loss": "tiled"}),
    Layout("tp2_dp2_zero2", GPT, 4, {**TP2, "zero_optimization.stage": 2}),
    # The last stage's untied head through the fused loss, its gradients computed in the forward and
    # scaled by the pipeline's 1/accumulation in backward.
    Layout(
        "pp2_dp2_zero1_2_micro_batches_llama_fused_loss",
        LLAMA,
        4,
        {**PP2, **TWO_MICRO_BATCHES, "zero_optimization.stage": 1, "model.loss": "fused"},
    ),
    Layout("pp2_tp2", GPT, 4, SHARED_RUNS["gpt_pp2_tp2"].layout, shared="gpt_pp2_tp2"),
    # PP2 x TP2 x DP2 on 8 ranks: test_deepspeeds_spellings_train_the_engines_layout_as_one_process,
    # which writes it as DeepSpeed's users do.
    # What GPT's rows do not reach: grouped-query attention split by heads (one key/value head per
    # shard), rotary positions computed on each stage, and an untied, vocabulary-split head.
    Layout("pp2_tp2_llama_gqa_untied", LLAMA, 4, SHARED_RUNS["llama_pp2_tp2"].layout, shared="llama_pp2_tp2"),
]


@pytest.mark.launch
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_layout_matches_single_process(
    layout: Layout, trained: Callable[[str], Trained], tmp_path: Path, request: pytest.FixtureRequest
):
    if layout.shared is not None:
        shared = trained(layout.shared)
        run, overrides = shared.run, shared.overrides
    else:
        overrides = layout.overrides
        run = launch(layout.config, overrides, tmp_path / "run", nproc=layout.nproc)
    reference = reference_run(layout.config, overrides, world_size=layout.nproc)
    assert len(run.losses) == len(reference.losses)
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    assert run.losses[-1] < run.losses[0]
    assert_weights_match(run.exported_state_dict(), reference.model, layout.weight_tolerance)
    if layout.config in (GPT, LLAMA):
        assert_eval_matches(run.records, reference.eval_loss, LOSS_TOLERANCE)
    assert_start_up_table(run.stdout, layout)
    assert_plan_matches_measured(run, layout.config, overrides, world_size=layout.nproc)
    if layout.config == LLAMA:
        # The round trip: the export, loaded by transformers alone, computes on the evaluation's
        # fixed batches the loss the split model computed on them; its tokenizer is the run's.
        exported = AutoModelForCausalLM.from_pretrained(run.output_dir / "export", dtype=torch.float32)
        assert abs(reference.evaluate(exported) - run.records[-1]["eval_loss"]) <= LOSS_TOLERANCE
    if layout.hf_tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(run.output_dir / "export")
        original = AutoTokenizer.from_pretrained(request.getfixturevalue("hf_tokenizer_dir"))
        assert tokenizer("To be, or not to be").input_ids == original("To be, or not to be").input_ids != []


# The 3D example (two stages x two tensor shards x two data replicas, 8 ranks) written as
# DeepSpeed's users write it: the stage count and the tensor-parallel degree under DeepSpeed's keys,
# and the stages' partitioned sends (DeepSpeed's defaults, written out).
# (Adam without bias correction, which needs DeepSpeed's own Adam, trains in test_config_launched.py,
# under offload, whose CPU Adam the suite builds anyway: FusedAdam's CPU build would cost 2 minutes.)
DEEPSPEED_SPELLED = {
    "pipeline": {"pipeline_parallel_size": 2, "pipe_partitioned": True, "grad_partitioned": True},
    "tensor_parallel": {"tp_size": 2},
}


@pytest.mark.launch
def test_deepspeeds_spellings_train_the_engines_layout_as_one_process(tmp_path: Path):
    config = tmp_path / "deepspeed_spelled.json"
    config.write_text(json.dumps({**json.loads((ROOT / GPT).read_text()), **DEEPSPEED_SPELLED}))
    overrides = {"trainer.max_steps": 4}
    run = launch(str(config), overrides, tmp_path / "run", nproc=8)
    reference = reference_run(str(config), overrides, world_size=8)
    assert len(run.losses) == 4
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert_grad_norms_match(run.records, reference.grad_norms)
    assert run.losses[-1] < run.losses[0]
    assert_weights_match(run.exported_state_dict(), reference.model, TENSOR_WEIGHT_TOLERANCE)
    assert_eval_matches(run.records, reference.eval_loss, LOSS_TOLERANCE)
    assert_start_up_table(run.stdout, Layout("deepspeed_spelled", str(config), 8, {**PP2, **TP2}))
    assert_plan_matches_measured(run, str(config), overrides, world_size=8)
    for spelled, key in (
        ("tensor_parallel.tp_size", "tensor_parallel_size"),
        ("pipeline.pipeline_parallel_size", "pipeline_parallel_size"),
    ):
        assert f"{spelled} is DeepSpeed's spelling of " in run.stdout and f"; read as parallel.{key}" in run.stdout
    # What ran, as handed to deepspeed.initialize: PipelineEngine reads the partitioned sends from it.
    resolved = json.loads((run.output_dir / "resolved_config.json").read_text())
    assert resolved["pipeline"] == {"pipe_partitioned": True, "grad_partitioned": True}
    assert "tensor_parallel" not in resolved


def assert_start_up_table(log: str, layout: Layout) -> None:
    """The start-up table says which stage, tensor shard and data replica every rank holds."""
    stages = layout.overrides.get("parallel.pipeline_parallel_size", 1)
    shards = layout.overrides.get("parallel.tensor_parallel_size", 1)
    replicas = layout.nproc // (stages * shards)
    assert (
        f"rank layout: {stages} pipeline stage(s) x {replicas} data-parallel replica(s) x {shards} tensor shard(s)"
        in log
    )
    last = f"rank {layout.nproc - 1}: stage {stages}/{stages}" + (" (layers " if stages > 1 else ",")
    assert last in log and f"tensor shard {shards}/{shards}, data replica {replicas}/{replicas}" in log


@pytest.mark.launch
@pytest.mark.parametrize(
    "parallel",
    [{"zero_optimization.stage": 0}, {**TP2, "zero_optimization.stage": 0}, {**PP2, "zero_optimization.stage": 1}],
    ids=["dp2", "tp2", "pp2"],
)
def test_bf16_export_holds_the_fp32_masters(parallel: dict, tmp_path: Path):
    """Under bf16 the model's weights are bf16; the export reads the optimizer's fp32 masters (the
    tied embedding and head included), and each rank holds the bytes the planner predicts for
    DeepSpeed's bf16 wrappers (per-parameter masters at ZeRO-0, BF16_Optimizer under the pipeline)."""
    overrides = {**parallel, "bf16.enabled": True, "trainer.max_steps": 2}
    run = launch(GPT, overrides, tmp_path / "run")
    weights = [tensor for name, tensor in run.exported_state_dict().items() if name.endswith("weight")]
    assert all(tensor.dtype == torch.float32 for tensor in weights)
    assert all((tensor.bfloat16().float() != tensor).any() for tensor in weights if tensor.dim() == 2)
    assert_plan_matches_measured(run, GPT, overrides, world_size=2)


def test_an_invalid_layout_is_refused_before_launch():
    """`validate` exits 2 with the rule's message, which names the key. Each layout rule (ZeRO-2 or 3
    under pipeline stages, more stages than blocks, heads or a ResNet split by tensor parallelism,
    ZeRO-3 with it, a world size the model-parallel degrees do not divide) has its row in
    tests/unit/test_config.py's test_rules_name_the_path_and_the_fix; this one has none there."""
    overrides = {**PP2, "zero_optimization.stage": 0, "bf16.enabled": "true"}
    sets = [f"--set={key}={value}" for key, value in overrides.items()]
    command = [sys.executable, "-m", "engine", "validate", GPT, "--world-size", "2", *sets]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "BF16_Optimizer cannot load" in result.stderr


def test_validate_prints_the_rank_layout_before_anything_launches():
    command = [sys.executable, "-m", "engine", "validate", "configs/3d.json", "--world-size", "8"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "data-parallel 2" in result.stdout
    assert "rank 6: stage 2/2, tensor shard 1/2, data replica 2/2" in result.stdout
