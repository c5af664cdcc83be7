"""parallel.sequence_parallel_size (and DeepSpeed's top-level spelling of it) through the public
validate path: the world it splits, what reaches DeepSpeed, and each thing DeepSpeed's Ulysses
cannot run, refused before any process group with one message naming the field. Likewise
model.tiled_mlp and model.loss "tiled" and "fused" where they cannot run. The runs themselves are launched
tests (tests/launched/)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.config import ConfigError, load_config
from engine.config.load import check_document
from engine.config.resolve import resolve
from engine.parallel.layout import parallel_layout
from tests.support.config import with_changes
from tests.support.launch import ROOT
from tests.unit.test_config import CPU, issues_of

CHAT = json.loads((ROOT / "configs" / "sft_llama_tiny.json").read_text())
# The tiny Llama preset: 4 query heads, 2 key/value heads, 64 positions.
LLAMA = {"family": "llama", "preset": "tiny"}


def base(**changes) -> dict:
    """tests/support/config.py's document (text data) with the tiny Llama, and `changes`."""
    return with_changes(**{"model": dict(LLAMA), **changes})


def llama(**fields) -> dict:
    return {**base(), "model": {**LLAMA, **fields}}


def chat(**data) -> dict:
    """configs/sft_llama_tiny.json (chat data, packed) at sequence_parallel_size 2, with `data` over its own."""
    return {**CHAT, "data": {**CHAT["data"], **data}, "parallel": {"sequence_parallel_size": 2}}


def sequence(document: dict, degree: int) -> dict:
    return {**document, "parallel": {**document.get("parallel", {}), "sequence_parallel_size": degree}}


def test_the_world_is_data_replicas_times_sequence_shards_and_deepspeed_is_told_the_degree():
    document = sequence(base(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), 2)
    config = resolve(check_document(document, 8, CPU), 8, CPU)
    assert config.dp_size == 4 and config.parallel.sequence_parallel_size == 2
    # DeepSpeed counts world / SP ranks in its batch arithmetic: the global batch is the replicas'.
    assert config.document["train_batch_size"] == 2 * 3 * 4
    assert config.deepspeed_config()["sequence_parallel_size"] == 2
    layout = parallel_layout(config)
    assert (layout.world_size, layout.zero_ranks) == (8, 8)
    one = resolve(check_document(base(), 8, CPU), 8, CPU)
    assert one.dp_size == 8 and "sequence_parallel_size" not in one.deepspeed_config()


def test_a_world_the_groups_do_not_divide_is_refused():
    assert issues_of(sequence(base(), 2), 3) == [
        "parallel: world size 3 is not divisible by tensor_parallel_size x pipeline_parallel_size x "
        "sequence_parallel_size = 2; launch a multiple of 2 processes"
    ]


def test_every_refusal_comes_at_once():
    """A config wrong in several ways is told all of them in one error."""
    document = sequence(llama(attn_implementation="eager"), 8)
    document["data"] = {"type": "text", "seq_len": 60}
    document["zero_optimization"] = {"stage": 3, "reduce_scatter": False}
    assert [issue.split(":")[0] for issue in issues_of(document, 8)] == [
        "data.seq_len",
        "model.attn_implementation",
        "model.num_attention_heads",
        "zero_optimization.reduce_scatter",
    ]


@pytest.mark.parametrize(
    "document, world_size, expected",
    [
        (
            sequence(base(data={"type": "text", "seq_len": 33}), 2),
            2,
            "data.seq_len: 33 tokens do not split into 2 equal slices (parallel.sequence_parallel_size), as "
            "DeepSpeed's Ulysses needs; use a multiple of 2 (32 or 34)",
        ),
        (
            sequence(base(), 8),
            8,
            "model.num_attention_heads: 4 attention heads cannot be split across sequence_parallel_size 8: inside "
            "attention each rank of the group computes heads / 8 of them over the whole sequence; use a degree that "
            "divides 4",
        ),
        (
            # 12 query heads split 6 ways, but 4 key/value heads neither split 6 ways nor divide 6.
            {
                **sequence(llama(hidden_size=48, num_attention_heads=12, num_key_value_heads=4), 6),
                "data": {"type": "text", "seq_len": 60},
            },
            6,
            "model.num_key_value_heads: 4 key/value heads neither split across sequence_parallel_size 6 nor divide "
            "it (DeepSpeed's Ulysses gives each rank kv / SP of them, or repeats each over SP / kv ranks); use a "
            "degree that divides 4 or is a multiple of it",
        ),
        (
            sequence(llama(attn_implementation="eager"), 2),
            2,
            'model.attn_implementation: "eager" attention needs the 4D mask DeepSpeed\'s Ulysses drops (it runs '
            'sdpa, flash and flex attention only); use "sdpa", which masks causally over the whole gathered sequence',
        ),
        (
            chat(),
            2,
            "data.packing: true under sequence parallelism: DeepSpeed's Ulysses drops the mask that keeps packed "
            "conversations apart, so each would attend to the ones before it in its sample; set it to false (every "
            "conversation is then padded to its micro-batch's longest, and on to a multiple of "
            "sequence_parallel_size)",
        ),
        (
            sequence(base(parallel={"tensor_parallel_size": 2}), 2),
            4,
            "parallel.tensor_parallel_size: 2 does not combine with sequence_parallel_size 2: DeepSpeed's Ulysses "
            "groups (parallel_state_sp) split the world into data x sequence ranks only; set it to 1 (ZeRO-3 "
            "partitions the model states over every rank instead)",
        ),
        (
            sequence(base(parallel={"pipeline_parallel_size": 2}), 2),
            4,
            "parallel.pipeline_parallel_size: 2 does not combine with sequence_parallel_size 2",
        ),
        (
            sequence(base(trainer={"backend": "accelerate"}), 2),
            2,
            "parallel.sequence_parallel_size: sequence parallelism runs inside DeepSpeed's engine (its "
            "sequence-parallel groups, and ZeRO's gradient reduction over them); launch with deepspeed and "
            'trainer.backend "deepspeed", or set it to 1',
        ),
        (
            sequence(base(zero_optimization={"stage": 3, "reduce_scatter": False}), 2),
            2,
            "zero_optimization.reduce_scatter: false under ZeRO-3 with sequence parallelism: DeepSpeed 0.19.8 "
            "averages ZeRO-3's gradients over the data-parallel ranks on its contiguous path but over data x "
            "sequence ranks on its reduce-scatter path, bucket by bucket, and the engine corrects the reduce-scatter "
            "one; set it to true",
        ),
        (
            sequence(base(model={"family": "gpt", "preset": "tiny"}), 2),
            2,
            "parallel.sequence_parallel_size: gpt models have no sequence-parallel form (transformers' GPT-2 "
            "attention reshapes what the attention function returns as (batch, tokens, heads, head width), and "
            "DeepSpeed's Ulysses returns it with the heads already merged",
        ),
        (
            sequence(base(model={"family": "resnet", "preset": "resnet18"}, data={"type": "synthetic"}), 2),
            2,
            "parallel.sequence_parallel_size: resnet models have no sequence-parallel form (Ulysses splits the "
            "attention of a transformers decoder by heads, and this family's data has no token sequence); set it to 1",
        ),
    ],
    ids=[
        "seq_len",
        "heads",
        "kv_heads",
        "eager",
        "packing",
        "tensor_parallel",
        "pipeline",
        "accelerate",
        "zero3_reduce_scatter",
        "gpt",
        "no_sequence_parallel_form",
    ],
)
def test_each_thing_ulysses_cannot_run_is_refused_naming_the_field(document: dict, world_size: int, expected: str):
    (issue,) = [issue for issue in issues_of(document, world_size) if issue.startswith(expected.split(":")[0])]
    assert issue.startswith(expected), issue


@pytest.mark.parametrize(
    "document, world_size",
    [
        # Key/value heads may be fewer than the ranks, each repeated over SP / kv of them.
        ({**sequence(llama(), 4), "data": {"type": "text", "seq_len": 64}}, 4),
        # Conversations are padded to a multiple of the degree: any seq_len passes.
        (chat(packing=False, seq_len=1023), 2),
        # ZeRO-3 with DeepSpeed's default reduce-scatter, and offload.
        (
            sequence(
                base(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}, model__tiled_mlp=True), 2
            ),
            4,
        ),
    ],
    ids=["kv_heads_repeated", "chat_padded", "zero3_offload"],
)
def test_what_ulysses_runs_validates(document: dict, world_size: int):
    assert check_document(document, world_size, CPU)["parallel"]["sequence_parallel_size"] > 1


def write(directory: Path, document: dict) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps(document))
    return path


def test_deepspeeds_top_level_spelling_is_read_as_the_engines_key_with_one_notice(tmp_path: Path):
    path = write(tmp_path, {**base(), "sequence_parallel_size": 2})
    config = load_config(path, [], world_size=4, hardware=CPU)
    assert config.notices == (
        "sequence_parallel_size is DeepSpeed's spelling of the sequence-parallel degree; read as "
        "parallel.sequence_parallel_size",
    )
    assert config.parallel.sequence_parallel_size == 2 and config.dp_size == 2
    assert "sequence_parallel_size" not in config.document
    assert config.deepspeed_config()["sequence_parallel_size"] == 2


def test_deepspeeds_spelling_beside_the_engines_key_with_another_value_is_refused(tmp_path: Path):
    path = write(tmp_path, {**sequence(base(), 4), "sequence_parallel_size": 2})
    with pytest.raises(ConfigError) as raised:
        load_config(path, [], world_size=4, hardware=CPU)
    assert [str(issue) for issue in raised.value.issues] == [
        "sequence_parallel_size: 2 here, but parallel.sequence_parallel_size is 4; both set the sequence-parallel "
        "degree, so keep one of them (or give them the same value)"
    ]


def test_an_override_of_the_engines_key_replaces_deepspeeds_spelling(tmp_path: Path):
    path = write(tmp_path, {**base(), "sequence_parallel_size": 2})
    config = load_config(path, ["parallel.sequence_parallel_size=1"], world_size=4, hardware=CPU)
    assert (config.parallel.sequence_parallel_size, config.dp_size, config.notices) == (1, 4, ())


def test_the_tiling_keys_default_off_for_the_decoders_only():
    filled = check_document(base(), 1, CPU)["model"]
    assert (filled["tiled_mlp"], filled["loss"]) == (False, "auto")
    resnet = base(model={"family": "resnet", "preset": "resnet18", "tiled_mlp": True}, data={"type": "synthetic"})
    (issue,) = issues_of(resnet)
    assert issue.startswith("model.tiled_mlp: unknown key")


@pytest.mark.parametrize(
    "document, world_size, expected",
    [
        (
            base(model__tiled_mlp=True, trainer={"backend": "accelerate"}),
            2,
            "model.tiled_mlp: DeepSpeed's tiled MLP runs several backward passes inside one",
        ),
    ],
    ids=["tiled_mlp_accelerate"],
)
def test_tiling_is_refused_where_it_cannot_run(document: dict, world_size: int, expected: str):
    assert [issue for issue in issues_of(document, world_size) if issue.startswith(expected)], expected


@pytest.mark.parametrize("loss", ["tiled", "fused"])
def test_the_loss_without_whole_logits_runs_under_tensor_parallelism(loss: str):
    """Each piece's logits come whole from the vocabulary-split head, which gathers them."""
    document = base(model__loss=loss, parallel={"tensor_parallel_size": 2})
    assert check_document(document, 2, CPU)["model"]["loss"] == loss


@pytest.mark.parametrize("loss", ["tiled", "fused"])
def test_the_loss_without_whole_logits_runs_on_the_last_pipeline_stage(loss: str):
    """The last stage computes it from its head's input (engine/backends/pipeline_backend.py)."""
    document = base(model__loss=loss, parallel={"pipeline_parallel_size": 2})
    assert check_document(document, 2, CPU)["model"]["loss"] == loss


@pytest.mark.parametrize("key, value", [("tiled_mlp", True), ("loss", "tiled"), ("loss", "fused")])
def test_tiling_unpacked_conversations_under_zero3_is_refused(key: str, value: object):
    """Each rank would cut its own micro-batch's length into its own number of pieces, and ZeRO-3
    gathers the weights once per piece."""
    document = chat(packing=False)
    document["model"] = {**document["model"], key: value}
    document["zero_optimization"] = {"stage": 3}
    (issue,) = [issue for issue in issues_of(document, 2) if issue.startswith(f"model.{key}")]
    assert "under ZeRO-3 with unpacked conversations" in issue
    document["zero_optimization"] = {"stage": 2}
    assert check_document(document, 2, CPU)["model"][key] == value


def test_the_tiled_mlp_with_dropout_is_refused():
    (issue,) = issues_of(llama(tiled_mlp=True, dropout=0.1))
    assert issue.startswith("model.tiled_mlp: with model.dropout 0.1: DeepSpeed's tiled MLP computes each piece again")


def test_liger_kernels_are_refused_without_a_cuda_device():
    """model.kernels "liger" needs Triton on CUDA: on this CPU machine the config is refused with the
    reason, naming the key; the default builds transformers' own modules."""
    (issue,) = issues_of(llama(kernels="liger"))
    assert issue.startswith('model.kernels: "liger" runs Triton kernels, which need a CUDA device')
    assert check_document(base(), 1, CPU)["model"]["kernels"] == "none"
