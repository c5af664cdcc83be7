"""The Llama family in one process: presets and overrides reach transformers' LlamaConfig, configs
that cannot run are refused naming the field, the pipeline layers compute the model exactly, the
tensor-parallel plan splits grouped-query attention on head boundaries, FLOPs match a counted
forward, and checkpoints round-trip with transformers tensor for tensor; `model.architecture`
builds Qwen2's and Mistral's classes from the same fields. The launched layouts are in
tests/launched."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from engine.config import ConfigError, load_config
from engine.launch.hardware import detect_hardware
from engine.plan.shapes import sharded_parameters
from models import get_family
from models.activation_checkpointing import Checkpointing
from models.costs import FLOPS_PER_MAC, TRAINING_PASSES, forward_macs
from models.module_state import count_parameters
from models.parallelize import ParallelRequest
from parallelism.tensor import Shard, shard_tensor
from tests.unit.test_parallel_forms import run_layers

ROOT = Path(__file__).resolve().parents[2]
LLAMA = get_family("llama")
TINY = {"family": "llama", "preset": "tiny", "vocab_size": 65}
# Each `model.architecture` (a Mistral window no shorter than the sequences is allowed).
ARCHITECTURES = [
    {},
    {"architecture": "qwen2"},
    {"architecture": "mistral"},
    {"architecture": "mistral", "sliding_window": 16},
]
ARCHITECTURE_IDS = ["llama", "qwen2", "mistral", "mistral-window"]


def tiny(**overrides) -> nn.Module:
    torch.manual_seed(0)
    checkpointing = Checkpointing.of(overrides.get("activation_checkpointing"))
    return LLAMA.parallelize(LLAMA.build({**TINY, **overrides}), ParallelRequest(checkpointing=checkpointing))


def test_tiny_builds_a_grouped_query_untied_llama():
    model = tiny()
    assert type(model).__name__ == "LlamaForCausalLM"
    config = model.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 8)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert model.training


@pytest.mark.parametrize(
    ("name", "model_class", "layer_class", "biased"),
    [
        ("llama", "LlamaForCausalLM", "LlamaDecoderLayer", False),
        ("qwen2", "Qwen2ForCausalLM", "Qwen2DecoderLayer", True),
        ("mistral", "MistralForCausalLM", "MistralDecoderLayer", False),
    ],
)
def test_each_architecture_builds_its_transformers_class(name: str, model_class: str, layer_class: str, biased: bool):
    model = tiny(architecture=name)
    assert type(model).__name__ == model_class and type(model.model.layers[0]).__name__ == layer_class
    assert model.config.model_type == name
    attention = model.model.layers[0].self_attn
    assert all((getattr(attention, f"{p}_proj").bias is not None) == biased for p in "qkv")
    assert attention.o_proj.bias is None
    assert (model.config.num_key_value_heads, model.config.hidden_size) == (2, 32)
    assert LLAMA.model_schema["architecture"]["default"] == "llama"


def test_mistral_takes_its_sliding_window_and_defaults_to_none():
    assert tiny(architecture="mistral").config.sliding_window is None
    assert tiny(architecture="mistral", sliding_window=48).config.sliding_window == 48
    assert tiny(architecture="qwen2").config.sliding_window is None


@pytest.mark.parametrize(("preset", "tied", "theta"), [("1B", True, 500000.0), ("8B", False, 500000.0)])
def test_planning_presets_have_the_published_shapes(preset: str, tied: bool, theta: float):
    with torch.device("meta"):
        model = LLAMA.build({"family": "llama", "preset": preset})
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.rope_parameters["rope_theta"] == theta
    assert model.config.vocab_size == 128256 and model.config.num_key_value_heads == 8


def test_every_architecture_field_reaches_llama_config():
    overrides = {
        "hidden_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "intermediate_size": 80,
        "max_position_embeddings": 16,
        "rope_theta": 1234.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": 70,
        "dropout": 0.25,
        "attn_implementation": "eager",
    }
    config = tiny(**overrides).config
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        assert getattr(config, field) == overrides[field], field
    for field in ("intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "vocab_size"):
        assert getattr(config, field) == overrides[field], field
    assert config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    assert config.attention_dropout == 0.25 and config._attn_implementation == "eager"
    assert LLAMA.hidden_size(LLAMA.architecture({**TINY, **overrides})) == 48
    assert LLAMA.context_length(LLAMA.architecture({**TINY, **overrides})) == 16


def test_activation_checkpointing_keeps_parameter_names():
    plain, checkpointed = tiny(), tiny(activation_checkpointing=True)
    assert [name for name, _ in plain.named_parameters()] == [name for name, _ in checkpointed.named_parameters()]
    assert checkpointed.model.gradient_checkpointing


# -- Configs refused before launch -------------------------------------------------------------


def refusals(tmp_path: Path, sets: list[str], world_size: int = 1) -> list[str]:
    document = json.loads((ROOT / "configs" / "llama_tiny.json").read_text())
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError) as raised:
        load_config(path, sets, world_size=world_size, hardware=detect_hardware(local_world_size=world_size))
    return [str(issue) for issue in raised.value.issues]


def test_the_shipped_config_validates():
    config = load_config(
        ROOT / "configs" / "llama_tiny.json", [], world_size=1, hardware=detect_hardware(local_world_size=1)
    )
    assert config.model.family == "llama"
    assert config.data.as_mapping()["seq_len"] == 32  # "auto": max_position_embeddings


@pytest.mark.parametrize(
    ("sets", "world_size", "expected"),
    [
        (
            ["model.num_attention_heads=3", "model.num_key_value_heads=1"],
            1,
            ["model.num_attention_heads: 3 heads do not divide hidden_size 32"],
        ),
        (
            ["model.hidden_size=24", "model.num_attention_heads=8", "model.num_key_value_heads=2"],
            1,
            ["model.num_attention_heads: 8 heads of hidden_size 24 are 3 wide; rotary embeddings"],
        ),
        (
            ["model.num_key_value_heads=3"],
            1,
            ["model.num_key_value_heads: 3 key/value heads do not divide num_attention_heads 4"],
        ),
        (
            ["parallel.tensor_parallel_size=8"],
            8,
            [
                "model.num_attention_heads: 4 attention heads cannot be split across tensor_parallel_size 8",
                "model.num_key_value_heads: 2 key/value heads cannot be split across tensor_parallel_size 8",
            ],
        ),
        (
            ["parallel.tensor_parallel_size=4"],
            4,
            ["model.num_key_value_heads: 2 key/value heads cannot be split across tensor_parallel_size 4"],
        ),
        (
            ["parallel.tensor_parallel_size=2", "model.intermediate_size=65"],
            2,
            ["model.intermediate_size: 65 MLP features (intermediate_size) cannot be split across"],
        ),
        (
            ["parallel.pipeline_parallel_size=3"],
            3,
            ["parallel.pipeline_parallel_size: 3 stages for a model of 2 LlamaDecoderLayer blocks"],
        ),
        (["data.seq_len=64"], 1, ["data.seq_len: 64 is longer than model.max_position_embeddings 32"]),
        (
            ["model.architecture=mistral", "model.sliding_window=16"],
            1,
            ["model.sliding_window: 16 is shorter than data.seq_len 32; the engine's pipeline layers"],
        ),
        (["model.sliding_window=64"], 1, ['model.sliding_window: model.architecture "llama" is built without']),
        (["model.architecture=gemma"], 1, ["model.architecture"]),
    ],
)
def test_configs_that_cannot_run_are_refused_naming_the_field(
    tmp_path: Path, sets: list[str], world_size: int, expected: list[str]
):
    messages = refusals(tmp_path, sets, world_size)
    assert len(messages) == len(expected), messages
    for message, start in zip(messages, expected, strict=True):
        assert message.startswith(start), messages


# -- Pipeline form -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=ARCHITECTURE_IDS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("tied", [False, True])
def test_pipeline_layers_compute_the_model_exactly(tied: bool, attention: str, arch: dict):
    model = tiny(tie_word_embeddings=tied, attn_implementation=attention, **arch).eval()
    tokens = torch.randint(0, 65, (2, 16))
    layers = LLAMA.pipeline.layers(model)
    assert len(layers) == LLAMA.pipeline.num_blocks(LLAMA.architecture(TINY)) + 3
    with torch.no_grad():
        expected = model(input_ids=tokens, use_cache=False).logits
        logits = run_layers(layers, tokens)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


def test_pipeline_puts_an_untied_head_on_the_last_stage_and_ties_a_tied_one():
    untied = tiny()
    layers = LLAMA.pipeline.layers(untied)
    assert layers[0] is untied.model.embed_tokens and layers[-1] is untied.lm_head
    tied = tiny(tie_word_embeddings=True)
    first, last = LLAMA.pipeline.layers(tied)[0], LLAMA.pipeline.layers(tied)[-1]
    assert first.key == last.key and last.forward_fn is not None
    assert first.build().embed_tokens.weight is tied.lm_head.weight


def test_pipeline_loss_is_transformers_causal_lm_loss():
    model = tiny().eval()
    tokens = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        expected = model(input_ids=tokens, labels=tokens, use_cache=False)
    shifted = LLAMA.pipeline.loss(expected.logits[:, :-1].contiguous(), tokens[:, 1:])
    torch.testing.assert_close(shifted, expected.loss, rtol=1e-6, atol=0)


# -- Tensor-parallel plan ----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES[:3], ids=ARCHITECTURE_IDS[:3])
@pytest.mark.parametrize("tied", [False, True])
def test_the_plan_names_modules_of_the_model(tied: bool, arch: dict):
    from fnmatch import fnmatchcase

    model = tiny(tie_word_embeddings=tied, **arch)
    plan = LLAMA.tensor_parallel
    names = [name for name, _ in model.named_modules()]
    for pattern in [*plan.column, *plan.row]:
        assert sum(fnmatchcase(name, pattern) for name in names) == 2, pattern
    assert isinstance(model.get_submodule(plan.vocab_embedding), nn.Embedding)
    assert isinstance(model.get_submodule(plan.head), nn.Linear)
    assert set(plan.divisible) <= set(LLAMA.architecture(TINY))
    # The planner counts the untied head among the split parameters.
    split = sharded_parameters(model, plan, 2)
    assert id(model.lm_head.weight) in split and id(model.model.embed_tokens.weight) in split
    assert id(model.model.norm.weight) not in split


@pytest.mark.parametrize("arch", ARCHITECTURES[:3], ids=ARCHITECTURE_IDS[:3])
def test_grouped_query_attention_splits_on_head_boundaries(arch: dict):
    """Each of two ranks keeps half the query heads and the key/value heads that serve them (and
    under Qwen2 their biases); the row-parallel output projections' partial sums add up to the
    unsplit attention, as the tensor-parallel layers' all-reduce adds them."""
    model = tiny(num_attention_heads=4, num_key_value_heads=2, **arch).eval()
    attention = model.model.layers[0].self_attn
    hidden = torch.randn(2, 8, 32)
    positions = torch.arange(8).unsqueeze(0)
    rotation = model.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        expected, _ = attention(hidden, position_embeddings=rotation, attention_mask=None)
        partial = []
        for rank in range(2):
            local = copy.deepcopy(attention)
            for name in ("q_proj", "k_proj", "v_proj"):
                full = getattr(attention, name)
                getattr(local, name).weight = nn.Parameter(shard_tensor(full.weight, Shard(0), rank, 2))
                if full.bias is not None:
                    getattr(local, name).bias = nn.Parameter(shard_tensor(full.bias, Shard(0), rank, 2))
            local.o_proj.weight = nn.Parameter(shard_tensor(attention.o_proj.weight, Shard(1), rank, 2))
            partial.append(local(hidden, position_embeddings=rotation, attention_mask=None)[0])
    torch.testing.assert_close(sum(partial), expected, rtol=1e-5, atol=1e-6)


def test_swiglu_splits_gate_and_up_by_column_and_down_by_row():
    mlp = tiny().model.layers[0].mlp
    hidden = torch.randn(2, 8, 32)
    with torch.no_grad():
        partial = []
        for rank in range(2):
            local = copy.deepcopy(mlp)
            for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
                getattr(local, name).weight = nn.Parameter(shard_tensor(getattr(mlp, name).weight, Shard(dim), rank, 2))
            partial.append(local(hidden))
        torch.testing.assert_close(sum(partial), mlp(hidden), rtol=1e-5, atol=1e-6)


# -- FLOPs and the planner ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES[:3], ids=ARCHITECTURE_IDS[:3])
@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_match_a_counted_forward(tied: bool, arch: dict):
    """6N + attention: N from every nn.Linear a forward pass runs (q, k and v at their grouped-query
    widths, o, gate, up, down and the head, hooked) plus the RMSNorm weights and Qwen2's q/k/v biases; attention
    over all query heads."""
    seq_len = 16
    section = {**TINY, "num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": tied, **arch}
    model = tiny(**section).eval()
    arch = LLAMA.architecture(section)
    linear_macs = forward_macs(model, torch.randint(0, 65, (1, seq_len))) // seq_len
    norms = sum(p.numel() for name, p in model.named_parameters() if name.endswith(("norm.weight", "bias")))
    attention = FLOPS_PER_MAC * TRAINING_PASSES * 2 * arch["num_hidden_layers"] * arch["hidden_size"] * seq_len
    expected = FLOPS_PER_MAC * TRAINING_PASSES * (linear_macs + norms) + attention
    assert LLAMA.flops_per_item(arch, {"seq_len": seq_len}) == expected
    # The embedding lookup is the only weight left out.
    assert linear_macs + norms == count_parameters(model) - (0 if tied else 65 * 32)


def test_plan_activations_shrink_with_tensor_parallelism_and_checkpointing():
    from models.activation_checkpointing import EVERY_BLOCK, NONE
    from models.costs import PlanShape

    section = {**TINY, "vocab_size": 64}
    estimates = [
        LLAMA.plan_activations(PlanShape(section, {"seq_len": 32}, None, (), 2, tensor, 4, 2)) for tensor in (1, 2)
    ]
    whole, split = estimates
    assert whole.stage_bytes(0, 2, NONE) > split.stage_bytes(0, 2, NONE) > split.stage_bytes(0, 2, EVERY_BLOCK)
    assert whole.boundaries == [4 * 32 * 32] and whole.hidden == 32
    # The peak comes with one layer's gradients in flight, or, on the last stage, the full loss's three
    # fp32 tensors of logits where they are larger; the last stage adds the final RMSNorm's input in
    # fp32 (4 bytes), its normalised states and its output (2 bytes each), per token and width.
    wide = {**section, "vocab_size": 4096, "loss": "full"}
    first_layer = LLAMA.plan_activations(PlanShape(wide, {"seq_len": 32}, None, (), 2, 1, 4, 2)).stage_bytes
    layer = first_layer(0, 1, NONE) // 2
    final_norm = 4 * 32 * 32 * (4 + 2 + 2)
    assert first_layer(1, 1, NONE) - first_layer(0, 1, NONE) == 3 * 4 * 4 * 32 * 4096 - layer + final_norm


# -- Checkpoints -------------------------------------------------------------------------------


# The tiny preset as a plain transformers config spells it.
HF_TINY = {
    "vocab_size": 65,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def write_checkpoint(path: Path, tied: bool) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(**HF_TINY, tie_word_embeddings=tied)).save_pretrained(path)
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("tied", [False, True])
def test_init_from_loads_exactly_the_checkpoint(tmp_path: Path, tied: bool):
    saved = write_checkpoint(tmp_path, tied)
    section = {**TINY, "tie_word_embeddings": tied, "init_from": str(tmp_path)}
    LLAMA.check_init_from(section)
    model = LLAMA.build(section)
    state = model.state_dict()
    assert set(saved) == set(state) - ({"lm_head.weight"} if tied else set())
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    assert model.training and (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_init_from_refuses_another_shape_or_family(tmp_path: Path):
    write_checkpoint(tmp_path / "llama", tied=False)
    with pytest.raises(ValueError, match=r"num_key_value_heads 2 \(configured: 4\); set these fields"):
        LLAMA.check_init_from({**TINY, "num_key_value_heads": 4, "init_from": str(tmp_path / "llama")})
    with pytest.raises(ValueError, match=r"tie_word_embeddings False \(configured: True\)"):
        LLAMA.check_init_from({**TINY, "tie_word_embeddings": True, "init_from": str(tmp_path / "llama")})
    gpt = get_family("gpt").build({"family": "gpt", "preset": "tiny", "vocab_size": 65})
    gpt.save_pretrained(tmp_path / "gpt")
    with pytest.raises(ValueError, match="holds a 'gpt2' checkpoint, not a Llama one"):
        LLAMA.check_init_from({**TINY, "init_from": str(tmp_path / "gpt")})


@pytest.mark.parametrize(
    ("arch", "model_class"),
    [
        ({}, "LlamaForCausalLM"),
        ({"architecture": "qwen2"}, "Qwen2ForCausalLM"),
        ({"architecture": "mistral", "sliding_window": 48}, "MistralForCausalLM"),
    ],
)
@pytest.mark.parametrize("tied", [False, True])
def test_export_round_trips_through_from_pretrained(tmp_path: Path, tied: bool, arch: dict, model_class: str):
    from transformers import AutoModelForCausalLM

    section = {**TINY, "tie_word_embeddings": tied, **arch}
    model = tiny(**section)
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    LLAMA.export(state, section, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == set(state) - ({"lm_head.weight"} if tied else set())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(loaded).__name__ == model_class
    assert getattr(loaded.config, "sliding_window", None) == arch.get("sliding_window")
    assert loaded.state_dict().keys() == state.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert type(LLAMA.load_export(tmp_path)).__name__ == model_class
    # The export is a model.init_from checkpoint of the same section, and of no other architecture.
    LLAMA.check_init_from({**section, "init_from": str(tmp_path)})
    rebuilt = LLAMA.build({**section, "init_from": str(tmp_path)}).state_dict()
    assert all(torch.equal(rebuilt[name], tensor) for name, tensor in state.items())
    other = {"architecture": "qwen2"} if not arch else {"architecture": "llama", "sliding_window": None}
    with pytest.raises(ValueError, match=f"holds a '{loaded.config.model_type}' checkpoint, not a"):
        LLAMA.check_init_from({**section, **other, "init_from": str(tmp_path)})


def test_init_from_refuses_a_mistral_checkpoint_of_another_window(tmp_path: Path):
    section = {**TINY, "architecture": "mistral", "sliding_window": 48}
    LLAMA.export(tiny(**section).state_dict(), section, tmp_path)
    with pytest.raises(ValueError, match=r"sliding_window 48 \(configured: None\); set these fields"):
        LLAMA.check_init_from({**section, "sliding_window": None, "init_from": str(tmp_path)})


def test_export_refuses_a_tied_head_that_differs_from_the_embedding(tmp_path: Path):
    section = {**TINY, "tie_word_embeddings": True}
    state = dict(tiny(**section).state_dict())
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="differ, but the model ties them"):
        LLAMA.export(state, section, tmp_path)
