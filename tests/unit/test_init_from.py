"""A pretrained directory is enough: `model.init_from`'s config.json decides the architecture as
`from_pretrained` reads it, the preset gives way, a field the user wrote that disagrees is refused
naming both values, and its tokenizer files are the tokenizer. Checked against transformers' own
reading of the same directories (AutoConfig, and the model it loads), at the config stage: no
weights are read and no process group starts. The launched run from such a directory is in
tests/launched/test_init_from_launched.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from engine.cli import main
from engine.config import ConfigError, load_config
from engine.launch.hardware import Hardware
from engine.plan import plan_run
from engine.preflight import check_data
from models import get_family, gpt_spec, llama_spec
from models import llama as llama_module
from tests.support.launch import ROOT
from tests.support.pretrained import write_tiny_llama

CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=1)
LLAMA, GPT = get_family("llama"), get_family("gpt")
# The model-section fields of the Llama family and the config.json keys that hold them, where they differ.
LLAMA_KEYS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "vocab_size": "vocab_size",
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
    "architecture": "model_type",
}


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A Llama directory as transformers writes it, of another shape than the engine's tiny preset."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def saved_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def issue_config(directory: Path, tmp_path: Path, **model: object) -> Path:
    """configs/llama_tiny.json, the config of the issue, starting from `directory`, with the model
    section's `model` changes (a value None removes the key)."""
    document = json.loads((ROOT / "configs" / "llama_tiny.json").read_text())
    document["model"]["init_from"] = str(directory)
    for key, value in model.items():
        if value is None:
            document["model"].pop(key, None)
        else:
            document["model"][key] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(document))
    return path


def minimal_config(path: Path, model: dict) -> Path:
    """A config of `model`, training on the embedded corpus 32 tokens at a time."""
    document = {"train_micro_batch_size_per_gpu": 2, "model": model, "data": {"type": "text", "seq_len": 32}}
    path.write_text(json.dumps(document))
    return path


def refusal(path: Path, overrides: list[str] = ()) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides, world_size=1, hardware=CPU)
    return [str(issue) for issue in caught.value.issues]


def test_the_directory_decides_the_architecture_the_preset_gave_way_to(tiny_llama: Path, tmp_path: Path):
    """The issue's config, less the one field it pins (below): the tiny preset's hidden 32 and
    intermediate 64 give way to the directory's 64 and 176, and to every other field it holds."""
    config = load_config(
        issue_config(tiny_llama, tmp_path, max_position_embeddings=None), [], world_size=1, hardware=CPU
    )
    saved, model = saved_config(tiny_llama), config.document["model"]
    assert {field: model[field] for field in LLAMA_KEYS} == {field: saved[key] for field, key in LLAMA_KEYS.items()}
    assert model["rope_theta"] == saved["rope_parameters"]["rope_theta"]
    assert config.data.seq_len == saved["max_position_embeddings"]  # "auto" takes the directory's context
    # transformers' own reading of the directory agrees with the section on every field it compares.
    LLAMA.check_init_from(config.model.fields)
    assert config.model.label == f"llama from {tiny_llama}"


def test_a_field_the_issue_config_writes_itself_is_held_to_the_directory(tiny_llama: Path):
    """configs/llama_tiny.json as shipped writes max_position_embeddings itself: that field alone is
    refused, naming both values, not the fields the preset would have supplied."""
    issues = refusal(ROOT / "configs" / "llama_tiny.json", [f"model.init_from={tiny_llama}"])
    context = saved_config(tiny_llama)["max_position_embeddings"]
    assert issues == [
        f"model.max_position_embeddings: is 32 but model.init_from {tiny_llama / 'config.json'} has {context}; "
        f"remove it or set {context}"
    ]


@pytest.mark.parametrize(
    "written,key",
    [
        ({"hidden_size": 32}, "hidden_size"),
        ({"num_key_value_heads": 4}, "num_key_value_heads"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"vocab_size": 512}, "vocab_size"),
        ({"architecture": "qwen2"}, "model_type"),
    ],
)
def test_a_written_field_that_disagrees_is_refused_naming_both_values(
    written: dict, key: str, tiny_llama: Path, tmp_path: Path
):
    ((field, value),) = written.items()
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None, **written)
    directory = json.dumps(saved_config(tiny_llama)[key])
    assert refusal(path) == [
        f"model.{field}: is {json.dumps(value)} but model.init_from {tiny_llama / 'config.json'} has {directory}; "
        f"remove it or set {directory}"
    ]


def test_a_written_field_that_agrees_and_vocab_size_auto_are_accepted(tiny_llama: Path, tmp_path: Path):
    saved = saved_config(tiny_llama)
    path = issue_config(
        tiny_llama, tmp_path, max_position_embeddings=None, hidden_size=saved["hidden_size"], vocab_size="auto"
    )
    model = load_config(path, [], world_size=1, hardware=CPU).document["model"]
    assert (model["hidden_size"], model["vocab_size"]) == (saved["hidden_size"], saved["vocab_size"])


def test_dropout_and_attention_kernel_stay_the_users(tiny_llama: Path, tmp_path: Path):
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None, dropout=0.1, attn_implementation="eager")
    model = load_config(path, [], world_size=1, hardware=CPU).document["model"]
    assert (model["dropout"], model["attn_implementation"]) == (0.1, "eager")


def test_no_checkpoint_of_the_family_is_refused_at_the_config_stage(tiny_llama: Path, tmp_path: Path):
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None)
    assert refusal(path, ["model.family=gpt", "model.preset=tiny"]) == [
        f"model.init_from: {tiny_llama} holds a 'llama' checkpoint, not a GPT-2 one"
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(path, [f"model.init_from={empty}"]) == [
        f"model.init_from: {empty} is not a transformers checkpoint: it holds no config.json, which save_pretrained "
        "writes beside the weights"
    ]
    assert refusal(path, [f"model.init_from={tmp_path / 'absent'}"]) == [
        f"model.init_from: '{tmp_path / 'absent'}' does not exist"
    ]
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    (gelu / "config.json").write_text(json.dumps({**saved_config(tiny_llama), "hidden_act": "gelu"}))
    assert refusal(path, [f"model.init_from={gelu}"]) == [
        f'model.init_from: {gelu} has hidden_act "gelu" (this family builds "silu"), which no model field configures'
    ]


def test_a_preset_is_needed_only_without_a_directory(tiny_llama: Path, tmp_path: Path):
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None, preset=None)
    assert load_config(path, [], world_size=1, hardware=CPU).model.preset is None
    (issue,) = refusal(path, ["model.init_from=null"])
    assert issue.startswith("model.preset: is required: name one of the llama presets (tiny, 1B, 8B), or set")


def test_the_tokenizer_defaults_to_the_directory(tiny_llama: Path, tmp_path: Path):
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None)
    written = load_config(path, [], world_size=1, hardware=CPU)
    assert written.data.tokenizer == "char"  # the issue's config names its tokenizer: it stays
    document = json.loads(path.read_text())
    del document["data"]["tokenizer"]
    path.write_text(json.dumps(document))
    config, bundle = check_data(load_config(path, ["data.seq_len=32"], world_size=1, hardware=CPU))
    assert config.data.tokenizer == str(tiny_llama)
    assert bundle.vocab_size == config.model.vocab_size == saved_config(tiny_llama)["vocab_size"]


def test_a_tokenizer_larger_than_the_embedding_is_refused_naming_both_sizes(tiny_llama: Path, tmp_path: Path):
    """A directory whose embedding has fewer rows than its tokenizer has tokens (config.json alone,
    edited: no weights are read to find out)."""
    smaller = tmp_path / "smaller"
    shutil.copytree(tiny_llama, smaller, ignore=shutil.ignore_patterns("*.safetensors"))
    rows = saved_config(tiny_llama)["vocab_size"] - 64
    (smaller / "config.json").write_text(json.dumps({**saved_config(tiny_llama), "vocab_size": rows}))
    path = minimal_config(tmp_path / "smaller.json", {"family": "llama", "init_from": str(smaller)})
    with pytest.raises(ConfigError) as caught:
        check_data(load_config(path, [], world_size=1, hardware=CPU))
    (issue,) = map(str, caught.value.issues)
    tokens = rows + 64
    assert issue.startswith(f'data.tokenizer: "{smaller}" has {tokens} tokens, more than the {rows} embedding rows')


def test_plan_counts_the_directory_model(tiny_llama: Path, tmp_path: Path):
    """`plan`'s parameter bytes (fp32, one rank, nothing sharded) are 4 bytes for each parameter of
    the model transformers loads from the directory."""
    path = issue_config(tiny_llama, tmp_path, max_position_embeddings=None)
    config = load_config(path, ["data.seq_len=32"], world_size=1, hardware=CPU)
    assert (config.precision, config.zero_stage, config.autocast) == ("fp32", 0, False)
    plan = plan_run(config, CPU)
    loaded = LlamaForCausalLM.from_pretrained(tiny_llama)
    assert plan.ranks[0].states.parameter == 4 * sum(parameter.numel() for parameter in loaded.parameters())


def test_validate_and_plan_read_config_json_alone(tiny_llama: Path, tmp_path: Path, capsys):
    """A directory holding config.json and nothing else validates and plans: no weights are read."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_llama / "config.json", bare / "config.json")
    path = minimal_config(tmp_path / "bare.json", {"family": "llama", "init_from": str(bare)})
    assert main(["validate", str(path), "--world-size", "1"]) == 0
    assert main(["plan", str(path), "--world-size", "1"]) == 0
    assert f"llama from {bare} on 1 rank(s)" in capsys.readouterr().out


# -- config.json as transformers reads it ------------------------------------------------------

ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "vocab_size": 128,
}
CONFIG_JSONS = {
    # Llama 3.2's config.json as the Hub holds it: rope_theta and rope_scaling at the top level.
    "llama3.2": {
        **SHAPE,
        "model_type": "llama",
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": ROPE_LLAMA3,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    # The first Llama conversions: no key/value heads, rotary base, norm epsilon or head tying.
    "llama1": {**SHAPE, "model_type": "llama", "max_position_embeddings": 2048},
    "linear_rope": {
        **SHAPE,
        "model_type": "llama",
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    },
    "transformers5_yarn": {
        **SHAPE,
        "model_type": "llama",
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    },
    "qwen2": {**SHAPE, "model_type": "qwen2", "num_key_value_heads": 2, "max_position_embeddings": 32768},
    "mistral_without_window": {**SHAPE, "model_type": "mistral", "max_position_embeddings": 32768},
    "mistral_full_attention": {
        **SHAPE,
        "model_type": "mistral",
        "max_position_embeddings": 32768,
        "sliding_window": None,
    },
}


@pytest.mark.parametrize("saved", CONFIG_JSONS.values(), ids=CONFIG_JSONS)
def test_older_and_other_config_json_spellings_read_as_transformers_reads_them(saved: dict, tmp_path: Path):
    """What the engine reads from a config.json, built into the transformers config the family
    trains, equals AutoConfig's reading of the same file on every field `check_init_from` compares."""
    (tmp_path / "config.json").write_text(json.dumps(saved))
    section = {
        **llama_spec.pretrained_fields(saved),
        "family": "llama",
        "init_from": str(tmp_path),
        "dropout": 0.0,
        "attn_implementation": "eager",
    }
    LLAMA.check_init_from(section)


def test_a_gpt2_directory_decides_the_gpt_architecture(tmp_path: Path):
    GPT2Config(n_layer=3, n_head=4, n_embd=48, n_positions=40, vocab_size=90).save_pretrained(tmp_path / "gpt2")
    path = minimal_config(
        tmp_path / "gpt.json", {"family": "gpt", "preset": "124M", "init_from": str(tmp_path / "gpt2")}
    )
    config = load_config(path, [], world_size=1, hardware=CPU)
    model, saved = config.document["model"], saved_config(tmp_path / "gpt2")
    assert {key: model[key] for key in gpt_spec.ARCHITECTURE_FIELDS} == {
        key: saved[key] for key in gpt_spec.ARCHITECTURE_FIELDS
    }
    GPT.check_init_from(config.model.fields)


@pytest.mark.parametrize(
    "name,config_class", [("llama", LlamaConfig), ("qwen2", Qwen2Config), ("mistral", MistralConfig)]
)
def test_what_a_config_json_may_leave_out_is_the_transformers_default(name: str, config_class: type):
    """A key left out of config.json reads as the config class's default: the defaults the engine
    assumes, and the values it always builds (which a checkpoint may therefore leave out), are
    transformers' own."""
    default, assumed = config_class(num_attention_heads=4, hidden_size=64), llama_spec.PRETRAINED_DEFAULTS[name]
    assert default.rope_parameters["rope_theta"] == assumed["rope_theta"]
    assert default.num_key_value_heads == (assumed["num_key_value_heads"] or 4)
    for key in set(assumed) - {"rope_theta", "num_key_value_heads"}:
        assert getattr(default, key) == assumed[key], key
    section = {**LLAMA.presets["tiny"], "vocab_size": 64, "architecture": name}
    built = llama_module.CHECKPOINTS[name].config(section)
    for key, value in llama_spec.BUILT_AS[name].items():
        assert getattr(default, key) == getattr(built, key) == value, key


def test_what_a_gpt2_config_json_may_leave_out_is_the_transformers_default():
    default, built = GPT2Config(), GPT.build({"preset": "tiny", "vocab_size": 64}).config
    for key, value in gpt_spec.BUILT_AS.items():
        assert getattr(default, key) == getattr(built, key) == value, key


def test_the_loaded_model_is_the_directorys(tiny_llama: Path, tmp_path: Path):
    """Built from the resolved section, the model holds the directory's weights, tensor for tensor,
    as transformers' from_pretrained loads them."""
    config = load_config(
        issue_config(tiny_llama, tmp_path, max_position_embeddings=None), [], world_size=1, hardware=CPU
    )
    built = LLAMA.build(config.model.fields).state_dict()
    loaded = LlamaForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert built.keys() == loaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(built[name], tensor), name
