"""LoRA without launches: what a config with model.lora is refused for, the planner's trainable and
frozen counts against peft's own, and the adapter export against peft's own loading of it. The
launched runs (ZeRO-2/3 against one process, resume, the exports of a real run) are in
tests/launched/test_lora_launched.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from data.chat.prompt import reply_prompt
from data.chat.samples import Conversations
from engine.checkpoints.export import export_model, load_exported
from engine.checkpoints.reshape import CheckpointManifest, ReshapeError, needs_conversion
from engine.config import ConfigError, load_config
from engine.launch.hardware import Hardware, detect_hardware
from engine.plan import plan_run, table, verdict
from engine.plan.planner import optimizer_kind, zero_settings
from engine.plan.states import element_bytes, state_bytes
from engine.preflight import check_lora_targets
from models import get_family
from models.lora import PEFT_PREFIX, apply_lora, export_adapter, lora_config, merged_model
from tests.support.pretrained import write_tiny_llama

LLAMA = "configs/llama_tiny.json"
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "modules_to_save": []}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def lora_config_file(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """configs/llama_tiny.json fine-tuning the tiny Llama with LoRA: its directory decides the
    architecture and the tokenizer, so the config's own shape keys go."""
    document = json.loads(Path(LLAMA).read_text())
    document["model"] = {"family": "llama", "init_from": str(tiny_llama), "lora": LORA}
    document["data"]["tokenizer"] = str(tiny_llama)
    path = tmp_path_factory.mktemp("config") / "lora.json"
    path.write_text(json.dumps(document))
    return str(path)


def lora_overrides(lora: dict | None = None, **others: object) -> list[str]:
    sets = {**({"model.lora": json.dumps(lora)} if lora is not None else {}), **others}
    return [f"{key}={value}" for key, value in sets.items()]


def load(config: str, overrides: list[str], world_size: int = 1):
    return load_config(config, overrides, world_size=world_size, hardware=detect_hardware(local_world_size=world_size))


def refusal(config: str, overrides: list[str], world_size: int = 1) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load(config, overrides, world_size)
    return {issue.path: issue.message for issue in caught.value.issues}


def test_lora_on_a_family_without_a_lora_form_is_refused_by_name():
    issues = refusal("configs/tiny_resnet.json", ['model.lora={"r": 4}'])
    assert set(issues) == {"model.lora"}
    assert "resnet models have no LoRA form" in issues["model.lora"] and "remove model.lora" in issues["model.lora"]


def test_lora_needs_the_base_it_adapts(tiny_llama: Path):
    issues = refusal(LLAMA, ['model.lora={"r": 4}'])
    assert set(issues) == {"model.init_from"}
    assert "trains adapters on a pretrained base" in issues["model.init_from"]


@pytest.mark.parametrize(
    "key, value, world_size, reason",
    [
        ("parallel.tensor_parallel_size", 2, 2, "peft's adapters, wrapped around them, do not know of"),
        ("parallel.pipeline_parallel_size", 2, 2, "saves every layer whole, the frozen base with it"),
    ],
)
def test_model_parallelism_with_lora_is_refused_with_its_reason(
    lora_config_file: str, key: str, value: int, world_size: int, reason: str
):
    issues = refusal(lora_config_file, lora_overrides(**{key: value, "zero_optimization.stage": 1}), world_size)
    assert reason in issues[key] and "Set it to 1" in issues[key]


def test_merging_an_export_without_lora_is_refused():
    issues = refusal(LLAMA, ["trainer.export_merge_lora=true"])
    assert set(issues) == {"trainer.export_merge_lora"}


def test_target_modules_that_match_nothing_name_the_model_layers(lora_config_file: str):
    lora = {**LORA, "target_modules": ["q_proj", "vproj", "norm"], "modules_to_save": ["head"]}
    with pytest.raises(ConfigError) as caught:
        check_lora_targets(load(lora_config_file, lora_overrides(lora)))
    issues = {issue.path: issue.message for issue in caught.value.issues}
    layers = "embed_tokens, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"
    assert issues == {
        "model.lora.target_modules[1]": f"'vproj' matches no module of the model; the layers LoRA adapts: {layers}",
        "model.lora.target_modules[2]": f"'norm' names no layer LoRA adapts (linear layers, embeddings): {layers}",
        "model.lora.modules_to_save[0]": "'head' matches no module of the model: model, embed_tokens, layers, "
        "self_attn, q_proj, k_proj, v_proj, o_proj, mlp, gate_proj, up_proj, down_proj, act_fn, input_layernorm, "
        "post_attention_layernorm, norm, rotary_emb, lm_head",
    }
    check_lora_targets(load(lora_config_file, []))


def test_a_lora_checkpoint_resumes_on_its_own_layout_only(tmp_path: Path):
    def layout(data: int, stage: int, lora: bool) -> CheckpointManifest:
        return CheckpointManifest("deepspeed", data, 1, 1, stage, 384, 1, None, 8, 100, lora=lora)

    assert not needs_conversion(layout(2, 3, True), layout(2, 3, True), tmp_path)
    with pytest.raises(ReshapeError, match="holds the adapters and their optimizer states alone"):
        needs_conversion(layout(2, 3, True), layout(4, 3, True), tmp_path)
    with pytest.raises(ReshapeError, match="model.lora: checkpoint .* holds model.lora's adapters alone"):
        needs_conversion(layout(2, 3, True), layout(2, 3, False), tmp_path)
    # A layout.json written before LoRA was recorded trained every weight.
    assert not CheckpointManifest.from_json(layout(2, 3, False).to_json().replace('"lora": false', '"x": 0')).lora


def peft_reference(base: Path, lora: dict) -> PeftModel:
    """peft's own model of the base and adapters, as a user builds it."""
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    return get_peft_model(model, lora_config(lora))


@pytest.mark.parametrize(
    "stage, backend, lora",
    [
        (2, "deepspeed", LORA),
        (3, "deepspeed", {**LORA, "target_modules": "all-linear", "modules_to_save": ["lm_head"]}),
        (0, "accelerate", LORA),
        (3, "accelerate", LORA),
    ],
)
def test_the_plan_counts_what_peft_trains_and_freezes(
    tiny_llama: Path, lora_config_file: str, stage: int, backend: str, lora: dict
):
    overrides = lora_overrides(lora, **{"zero_optimization.stage": stage, "trainer.backend": backend})
    plan = plan_run(load(lora_config_file, overrides, world_size=2))
    trainable, total = peft_reference(tiny_llama, lora).get_nb_trainable_parameters()
    assert (plan.trainable, plan.frozen) == (trainable, total - trainable)
    if backend == "deepspeed":
        # The frozen base adds parameter bytes alone: the same rank planned without it holds exactly
        # its trainable states, and the base in the training dtype: whole below ZeRO-3; under it a
        # piece of numel / dp of each, and the whole of each persistent one besides.
        zero = zero_settings(plan.config, accelerator=False)
        model = apply_lora(LlamaForCausalLM.from_pretrained(tiny_llama), lora, seed=0)
        frozen = [p.numel() for p in model.parameters() if not p.requires_grad]
        trainable = [[p.numel() for p in model.parameters() if p.requires_grad]]
        trained = state_bytes(trainable, zero, 2, 0, optimizer_kind(plan.config))
        if stage == 3:
            persistent = [numel for numel in frozen if numel <= zero.persistence_threshold]
            assert persistent, "the tiny Llama's norms stay whole under the resolved threshold"
            pieces = [math.ceil(numel / 2) for numel in frozen] + persistent
        else:
            pieces = frozen
        held = element_bytes(plan.config.precision) * sum(pieces)
        assert plan.ranks[0].states.gradient == trained.gradient
        assert plan.ranks[0].states.optimizer == trained.optimizer
        assert plan.ranks[0].states.parameter == trained.parameter + held


def trained_lora_state(base: Path, lora: dict) -> dict[str, torch.Tensor]:
    """The trained tensors of a run's checkpoint (its names: the base's, adapters added), with values
    no initialisation gives (lora_B starts at zero), so that a reload which kept initial values fails."""
    model = apply_lora(LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), lora, seed=0)
    generator = torch.Generator().manual_seed(3)
    trained = [(name, p.shape) for name, p in model.named_parameters() if p.requires_grad]
    return {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in trained}


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(40).reshape(2, 20)).logits


@pytest.mark.parametrize("lora", [LORA, {**LORA, "target_modules": "all-linear", "modules_to_save": ["lm_head"]}])
def test_the_exported_adapter_loads_on_its_base_with_peft(
    tiny_llama: Path, lora_config_file: str, tmp_path: Path, lora: dict
):
    config = load(lora_config_file, lora_overrides(lora))
    family, section = get_family("llama"), config.model.fields
    state = trained_lora_state(tiny_llama, lora)
    written = export_model(family, state, section, tmp_path / "adapter")
    assert written == f"the LoRA adapter (peft) for the base model {tiny_llama}"
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tiny_llama) and saved["r"] == lora["r"]
    # What peft's own save_pretrained writes of the same model: the same names and values.
    reference = peft_reference(tiny_llama, lora)
    reference.load_state_dict({PEFT_PREFIX + name: value for name, value in state.items()}, strict=False)
    reference.save_pretrained(tmp_path / "peft")
    ours, peft_own = (
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert ours.keys() == peft_own.keys()
    for name in ours:
        assert torch.equal(ours[name], peft_own[name]), name

    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tiny_llama), tmp_path / "adapter").eval()
    expected = logits_of(reference.eval())
    torch.testing.assert_close(logits_of(loaded), expected, rtol=0, atol=0)
    as_engine_loads_it = load_exported(family, section, tmp_path / "adapter")
    torch.testing.assert_close(logits_of(as_engine_loads_it), expected, rtol=0, atol=0)

    merged = export_model(family, state, section, tmp_path / "merged", merge_lora=True)
    assert merged.startswith("the LoRA adapter merged into the weights of")
    from_merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(logits_of(from_merged), expected, rtol=0, atol=1e-5)


def test_an_adapter_that_lacks_a_trained_tensor_is_refused(tiny_llama: Path):
    state = trained_lora_state(tiny_llama, LORA)
    del state[next(iter(state))]
    base = LlamaForCausalLM.from_pretrained(tiny_llama)
    with pytest.raises(ValueError, match="the checkpoint's adapter does not match model.lora: missing: base_model"):
        merged_model(base, {"lora": LORA}, state)


def test_the_llama3_8b_lora_config_fits_a_node_of_80gib_gpus_before_its_weights_are_downloaded():
    """configs/sft_llama3_8b_lora.json planned as its comment says, for 8 GPUs of 80 GiB, with its
    model.init_from not there: the 8B preset stands for it. LoRA r 16 on every linear layer of each of
    the 32 decoder layers adds r x (inputs + outputs) per projection; the rest is Llama 3 8B, frozen."""
    gpus = Hardware("cuda", True, True, cpu_count=16, local_world_size=8, name="NVIDIA H100 80GB HBM3")
    config = load_config("configs/sft_llama3_8b_lora.json", [], world_size=8, hardware=gpus, pretrained_required=False)
    plan = plan_run(config, gpus, None)
    hidden, kv, inner, layers, vocab, r = 4096, 1024, 14336, 32, 128256, 16
    projections = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)] + [(hidden, inner)] * 2
    projections.append((inner, hidden))
    assert plan.trainable == layers * sum(r * (inputs + outputs) for inputs, outputs in projections)
    base = 2 * vocab * hidden + layers * (sum(i * o for i, o in projections) + 2 * hidden) + hidden
    assert plan.frozen == base
    fits, text = verdict(plan, 80 * 2**30, None)
    assert fits, text
    assert f"LoRA r 16 on all-linear: {plan.trainable:,} parameters train" in table(plan)


def test_gpt2s_conv1d_projections_take_adapters_that_export_and_merge(tmp_path: Path):
    """GPT-2 keeps its projections in transformers' Conv1D (weights stored transposed), which peft
    adapts with fan_in_fan_out: the exported adapter reloads on the base, and merges into it, with the
    logits of the model that trained it."""
    base_dir = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=128)).save_pretrained(
        base_dir
    )
    lora = {**LORA, "target_modules": "all-linear"}
    section = {"lora": lora, "init_from": str(base_dir)}
    trained = apply_lora(GPT2LMHeadModel.from_pretrained(base_dir), lora, seed=0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in (p for p in trained.parameters() if p.requires_grad):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    state = {name: p.detach().clone() for name, p in trained.named_parameters() if p.requires_grad}
    assert any(".attn.c_attn.lora_A" in name for name in state) and not any("lm_head" in name for name in state)
    expected = logits_of(trained.eval())

    with torch.device("meta"):
        meta = GPT2LMHeadModel(GPT2LMHeadModel.config_class.from_pretrained(base_dir))
    export_adapter(meta, section, state, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits_of(loaded), expected, rtol=0, atol=0)
    merged = merged_model(GPT2LMHeadModel.from_pretrained(base_dir), section, state).eval()
    torch.testing.assert_close(logits_of(merged), expected, rtol=0, atol=1e-5)


def test_the_sample_prompt_is_a_conversation_up_to_its_last_answer():
    """data/chat/prompt.py: the ids before the last run of targets, which the template renders as the
    conversation up to its last answer with the assistant's turn opened; none where every token is a
    target (data.train_on "all")."""
    # Two conversations: system+user, answer, user, answer; then one trained on every token.
    tokens = np.arange(14, dtype=np.uint16)
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1], dtype=np.uint8)
    conversations = Conversations(tokens, mask, np.array([0, 10, 14]), (("sample.jsonl", 2),))
    assert reply_prompt(conversations, 0) == [0, 1, 2, 3, 4, 5, 6]
    assert reply_prompt(conversations, 1) is None
