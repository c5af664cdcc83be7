"""The planner on the CPU, without launches: exact model-state bytes worked out here from the
architecture (not copied from the planner), verdicts, explain and suggest, and bad input."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.utils import partition_balanced

from engine.config import load_config
from engine.hardware import detect_hardware
from engine.plan import parse_bytes, plan_run
from models import get_family
from tests.support.launch import ROOT

GPT2 = "configs/gpt2_124m.json"
RESNET = "configs/tiny_resnet.json"
HIDDEN, LAYERS, VOCAB, POSITIONS = 768, 12, 50257, 1024
# The planner reads no data, so the config's corpus need not exist here; GPT-2's own vocabulary
# (the config's byte tokenizer would otherwise settle "auto" to 256 rows).
NO_DATA = ["data.path=null", f"model.vocab_size={VOCAB}"]


def gpt2_parameter_numels() -> list[int]:
    """GPT-2 124M's parameters in registration order, from its shape."""
    block = [HIDDEN, HIDDEN, HIDDEN * 3 * HIDDEN, 3 * HIDDEN, HIDDEN * HIDDEN, HIDDEN, HIDDEN, HIDDEN]
    block += [HIDDEN * 4 * HIDDEN, 4 * HIDDEN, 4 * HIDDEN * HIDDEN, HIDDEN]
    return [VOCAB * HIDDEN, POSITIONS * HIDDEN, *block * LAYERS, HIDDEN, HIDDEN]


def gpt2_matrix_numels() -> list[int]:
    """The parameters of GPT-2 124M that weight decay reaches: the embeddings and the four weight
    matrices of each block; the rest are biases and LayerNorm gains."""
    block = [HIDDEN * 3 * HIDDEN, HIDDEN * HIDDEN, HIDDEN * 4 * HIDDEN, 4 * HIDDEN * HIDDEN]
    return [VOCAB * HIDDEN, POSITIONS * HIDDEN, *block * LAYERS]


def plan_of(config: str, world_size: int, overrides: list[str]):
    hardware = detect_hardware(local_world_size=world_size)
    document = load_config(config, [*NO_DATA, *overrides], world_size=world_size, hardware=hardware)
    return plan_run(document)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The command checks the data as a launch would; synthetic data fills any batch."""
    command = [sys.executable, "-m", "engine", *args, "--set=data.type=synthetic"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_gpt2_zero3_offload_on_8_ranks_holds_an_eighth_of_each_parameter():
    overrides = [
        "zero_optimization.stage=3",
        "zero_optimization.offload_optimizer.device=cpu",
        "zero_optimization.offload_param.device=cpu",
        "bf16.enabled=false",
        "fp16.enabled=false",
    ]
    plan = plan_of(GPT2, 8, overrides)
    numels = gpt2_parameter_numels()
    assert sum(numels) == 124_439_808
    partition = sum(-(-numel // 8) for numel in numels)
    persistent = sum(numel for numel in numels if numel <= 10 * HIDDEN)  # the resolved threshold
    for rank in plan.ranks:
        assert rank.states.parameter == 4 * (partition + persistent)
        # Device reduce-scatter buffer plus the fp32 host gradient of the offloaded master.
        assert rank.states.gradient == 2 * 4 * partition
        # fp32 master and Adam's two moments; DeepSpeedCPUAdam keeps no step tensor.
        assert rank.states.optimizer == 3 * 4 * partition
        assert rank.states.offloaded == 4 * partition + 4 * partition + 3 * 4 * partition


def test_zero0_holds_everything_and_torch_adam_adds_its_step_tensors():
    plan = plan_of(GPT2, 2, ["zero_optimization.stage=0", "bf16.enabled=false", "fp16.enabled=false"])
    numels = gpt2_parameter_numels()
    states = plan.ranks[0].states
    assert (states.parameter, states.gradient) == (4 * sum(numels), 4 * sum(numels))
    assert states.optimizer == 8 * sum(numels) + 4 * len(numels)


def test_zero1_pads_and_partitions_each_optimizer_group_on_its_own():
    """Decay on the matrices only makes two groups; ZeRO pads each to a multiple of 2 x dp and
    cuts it into dp partitions, and torch's Adam keeps one step tensor per partition."""
    overrides = ["zero_optimization.stage=1", "bf16.enabled=false", "fp16.enabled=false", "train_batch_size=400"]
    plan = plan_of(GPT2, 5, overrides)
    matrices = sum(gpt2_matrix_numels())
    vectors = sum(gpt2_parameter_numels()) - matrices
    padded = [-(-group // 10) * 10 for group in (matrices, vectors)]
    assert padded != [matrices, vectors]  # 5 ranks: both groups need padding
    for rank in plan.ranks:
        assert rank.states.parameter == 4 * sum(padded)
        assert rank.states.optimizer == sum(3 * 4 * group // 5 + 4 for group in padded)


def test_fsdp_allocates_padded_row_pieces_and_the_last_rank_holds_fewer_rows():
    """The accelerate backend's FSDP2 cuts each parameter into pieces of ceil(rows / 3) rows. GPT-2's
    50257 vocabulary rows and 1024 positions do not divide by 3: every rank allocates 16753 and 342
    of them for the weight and its gradient, but the last rank's Adam moments cover only the 16751
    and 340 it holds. Every other first dimension (768, 2304, 3072) divides by 3."""
    overrides = [
        "trainer.backend=accelerate",
        "zero_optimization.stage=3",
        "zero_optimization.offload_param.device=cpu",
        "bf16.enabled=false",
        "fp16.enabled=false",
        "train_batch_size=384",
    ]
    plan = plan_of(GPT2, 3, overrides)
    numels = gpt2_parameter_numels()
    embeddings = (16753 + 342) * HIDDEN
    padded = embeddings + sum(numels[2:]) // 3
    held = [padded, padded, padded - (2 + 2) * HIDDEN]  # elements with moments, by rank
    steps = 4 * len(numels)  # torch's Adam: one step tensor per parameter
    for rank, elements in zip(plan.ranks, held, strict=True):
        assert (rank.states.parameter, rank.states.gradient) == (4 * padded, 4 * padded)
        assert rank.states.optimizer == 2 * 4 * elements + steps
        assert rank.states.offloaded == rank.states.total  # CPUOffloadPolicy: everything lives on the host


def test_cli_plan_fits_80gib_and_says_so():
    result = run_cli(
        "plan",
        GPT2,
        f"--set=model.vocab_size={VOCAB}",
        "--world-size",
        "8",
        "--device-memory",
        "80GiB",
        "--host-memory",
        "512GiB",
        "--set",
        "zero_optimization.stage=3",
        "--set",
        "zero_optimization.offload_optimizer.device=cpu",
    )
    assert result.returncode == 0, result.stderr
    assert "device:" in result.stdout and "fits" in result.stdout and "does not fit" not in result.stdout


def test_cli_plan_reports_by_how_much_it_does_not_fit():
    result = run_cli("plan", GPT2, "--world-size", "2", "--device-memory", "1GiB")
    assert result.returncode == 1
    assert "does not fit" in result.stdout and "over" in result.stdout


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--device-memory", "80GB?"], "'80GB?' is not a memory size"),
        (["--set", "model.n_layers=3"], "model.n_layers"),
    ],
)
def test_cli_plan_refuses_bad_input_with_one_message(args: list[str], expected: str):
    result = run_cli("plan", "configs/tiny_gpt.json", "--world-size", "2", *args)
    assert result.returncode == 2
    assert expected in result.stderr


def test_explain_tells_each_rank_its_place_and_share():
    result = run_cli("explain", "configs/3d.json", "--world-size", "8")
    assert result.returncode == 0, result.stderr
    assert "rank 3: stage 1 of 2" in result.stdout
    assert "TP shard 2 of 2" in result.stdout


def test_suggest_lists_only_layouts_that_fit_cheapest_first():
    from engine.plan import suggest
    from engine.plan.report import verdict

    hardware = detect_hardware(local_world_size=2)

    def load(extra: list[str]):
        return load_config("configs/tiny_gpt.json", extra, world_size=2, hardware=hardware)

    config = load([])
    zero2 = plan_run(load(["zero_optimization.stage=2"]))
    limit = zero2.device_peak  # ZeRO-0 holds more, so it must be left out
    candidates = suggest(config, load, limit, None)
    assert candidates
    assert all(verdict(candidate.plan, limit, None)[0] for candidate in candidates)
    volumes = [candidate.plan.communication for candidate in candidates]
    assert volumes == sorted(volumes)
    assert all(
        candidate.plan.config.zero_stage != 0 or candidate.plan.ranks[0].device <= limit for candidate in candidates
    )


def test_memory_sizes_parse_in_both_unit_systems():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512 GB") == 512 * 10**9
    assert parse_bytes("1024") == 1024
    with pytest.raises(ValueError):
        parse_bytes("80GB?")


@pytest.mark.parametrize("config", ["configs/tiny_resnet.json", "configs/tiny_gpt.json"])
def test_the_type_partition_splits_the_blocks_where_deepspeed_does(config: str):
    """DeepSpeed's own matcher (`PipelineModule._find_layer_type`, a regular expression searched in
    each layer's class name) and its balancing, against the layer ranges the planner reports."""
    overrides = ["parallel.pipeline_parallel_size=2", "parallel.pipeline_partition_method=type"]
    plan = plan_run(load_config(config, overrides, world_size=2, hardware=detect_hardware(local_world_size=2)))
    family = get_family(plan.config.model["family"])
    with torch.device("meta"):
        layers = family.pipeline.layers(family.build(plan.config.model))
    matcher = types.SimpleNamespace(_layer_specs=layers)
    blocks = PipelineModule._find_layer_type(matcher, family.pipeline.block_type)
    parts = partition_balanced([1 if index in blocks else 0 for index in range(len(layers))], num_parts=2)
    assert len(blocks) == family.pipeline.num_blocks(family.architecture(plan.config.model))
    assert [rank.layers for rank in plan.ranks] == [f"layers {parts[s]}-{parts[s + 1] - 1}" for s in (0, 1)]


def test_resnet_stages_send_the_feature_map_at_their_cut():
    """ResNet-18 at 64 pixels cut by block type after its fourth block (the second of the 128-channel
    stage, an 8x8 map): stage 1 sends those activations forward, stage 2 their gradient back."""
    overrides = ["parallel.pipeline_parallel_size=2", "parallel.pipeline_partition_method=type"]
    config = load_config(RESNET, overrides, world_size=2, hardware=detect_hardware(local_world_size=2))
    plan = plan_run(config)
    micro, fp32 = config.document["train_micro_batch_size_per_gpu"], 4
    assert config.data["image_size"] == 64 and config.document["gradient_accumulation_steps"] == 1
    assert [rank.layers for rank in plan.ranks] == ["layers 0-4", "layers 5-9"]
    assert [rank.communication.pipeline for rank in plan.ranks] == [micro * 128 * 8 * 8 * fp32] * 2
