"""The config contract: every shipped config validates, and every rule and unknown key fails with
the JSON path in the message, before anything starts."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path

import pytest

from engine.config import ConfigError, load_config
from engine.config.batch import BatchError, solve_batch_triple
from engine.config.load import check_document, read_document
from engine.config.overrides import apply_overrides
from engine.config.reference import render_reference
from engine.config.resolve import resolve
from engine.config.validate import fill_defaults
from engine.launch.hardware import Hardware
from models.resnet_spec import torchvision_available
from tests.support.config import BASE, with_changes
from tests.support.launch import ROOT

CONFIGS = sorted((ROOT / "configs").glob("*.json"))
CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=2)
GPU = Hardware(
    "cuda", bf16_supported=True, fp16_supported=True, cpu_count=16, local_world_size=8, name="NVIDIA H100 80GB HBM3"
)


def fake_cifar(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        with open(directory / name, "wb") as handle:
            pickle.dump({b"data": [], b"labels": []}, handle)
    return directory


def issues_of(document: dict, world_size: int = 1, hardware: Hardware | None = CPU) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        check_document(document, world_size, hardware)
    return [str(issue) for issue in caught.value.issues]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
@pytest.mark.parametrize("world_size,hardware", [(1, CPU), (8, GPU)], ids=["1cpu", "8gpu"])
def test_shipped_config_validates(path: Path, world_size: int, hardware: Hardware, tmp_path: Path):
    document = read_document(path)
    parallel = document.get("parallel", {})
    # A model- or sequence-parallel config needs at least one rank per stage and shard.
    split = [parallel.get(f"{kind}_parallel_size", 1) for kind in ("tensor", "pipeline", "sequence")]
    world_size = max(world_size, split[0] * split[1] * split[2])
    overrides = []
    data_path = document["data"].get("path")
    if data_path and not (ROOT / data_path).exists():
        # Shipped configs name data the user provides; stand in an empty dataset of the right shape.
        stand_in = fake_cifar(tmp_path / "cifar") if document["data"]["type"] == "image" else tmp_path / "x.txt"
        stand_in.touch()
        overrides.append(f"data.path={stand_in}")
    # Shipped configs name pretrained weights the user downloads (model.init_from): the preset stands in.
    config = load_config(path, overrides, world_size=world_size, hardware=hardware, pretrained_required=False)
    doc = config.document
    assert doc["train_batch_size"] == (
        doc["train_micro_batch_size_per_gpu"] * doc["gradient_accumulation_steps"] * config.dp_size
    )
    assert '"auto"' not in json.dumps({k: v for k, v in doc.items() if k != "model"})


def test_minimal_config_gets_explicit_defaults():
    filled = fill_defaults(BASE)
    assert filled["gradient_clipping"] == 1.0
    assert filled["optimizer"]["type"] == "AdamW"
    assert filled["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert filled["optimizer"]["params"]["adam_w_mode"] is True
    assert filled["zero_optimization"]["stage"] == 0
    assert filled["model"]["dropout"] == 0.0
    assert "num_classes" not in filled["model"]  # ResNet-only default stays out of a GPT config
    assert filled["trainer"]["max_steps"] == 1000
    assert filled["parallel"] == {
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "pipeline_partition_method": "parameters",
        "pipeline_activation_checkpoint_interval": 0,
        "sequence_parallel_size": 1,
    }


@pytest.mark.parametrize(
    "document,expected",
    [
        (
            {**BASE, "zero_optimisation": {"stage": 2}},
            'zero_optimisation: unknown key (did you mean "zero_optimization"?)',
        ),
        (with_changes(zero_optimization__stag=2), 'zero_optimization.stag: unknown key (did you mean "stage"?)'),
        (with_changes(trainer__max_step=3), 'trainer.max_step: unknown key (did you mean "max_steps"?)'),
        (with_changes(model__n_heads=4), 'model.n_heads: unknown key (did you mean "n_head"?)'),
        (with_changes(model__num_classes=4), "model.num_classes: unknown key"),
        (
            with_changes(optimizer={"type": "AdamW", "params": {"momentum": 0.9}}),
            "optimizer.params.momentum: unknown key",
        ),
        (with_changes(optimizer={"type": "AdamX"}), "optimizer.type: 'AdamX' is not an optimizer DeepSpeed"),
        (with_changes(optimizer={"params": {"lr": "abc"}}), "optimizer.params.lr: expected a number > 0"),  # AdamW's
        (
            with_changes(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 1}}),
            'scheduler.params.warmup_num_steps: expected an integer >= 2 or "auto", got 1',  # DeepSpeed would run 2
        ),
        (with_changes(model__preset="125M"), "model.preset: '125M' is not one of"),
        (
            with_changes(zero_optimization__stage=4),
            'zero_optimization.stage: expected an integer >= 0 <= 3 or "auto", got 4',
        ),
        (
            with_changes(train_micro_batch_size_per_gpu="two"),
            'train_micro_batch_size_per_gpu: expected an integer >= 1 or "auto"',
        ),
        ({"model": BASE["model"]}, "data: is required"),
        (with_changes(gradient_clipping=float("nan")), "gradient_clipping: nan is not a finite number"),
        (
            with_changes(optimizer={"type": "AdamW", "params": {"betas": [0.9, float("inf")]}}),
            "optimizer.params.betas[1]: inf is not a finite number",
        ),
    ],
)
def test_schema_errors_name_the_path(document: dict, expected: str):
    assert any(issue.startswith(expected) for issue in issues_of(document)), issues_of(document)


def test_every_schema_error_is_reported_at_once():
    document = with_changes(trainer__max_step=3, zero_optimization__stage=7, model__n_heads=2)
    messages = issues_of(document)
    assert len(messages) == 3
    assert [m.split(":")[0] for m in messages] == ["model.n_heads", "trainer.max_step", "zero_optimization.stage"]


@pytest.mark.parametrize(
    "document,world_size,expected",
    [
        (
            with_changes(train_batch_size=6),
            2,
            "train_batch_size: 6 is not divisible by train_micro_batch_size_per_gpu 2 x data-parallel size 2",
        ),
        (
            with_changes(train_batch_size=8, gradient_accumulation_steps=3),
            1,
            "train_batch_size: 8 != train_micro_batch_size_per_gpu 2",
        ),
        (
            with_changes(fp16={"enabled": True}, bf16={"enabled": True}, zero_optimization={"stage": 1}),
            1,
            "fp16.enabled: fp16 and bf16 are both enabled",
        ),
        (
            with_changes(fp16={"enabled": True}, zero_optimization={"stage": 1}),
            1,
            "fp16.enabled: this CPU does not support fp16",
        ),
        (
            with_changes(torch_autocast={"enabled": True}, bf16={"enabled": True}),
            1,
            "torch_autocast.enabled: torch_autocast and bf16.enabled are both on; choose one",
        ),
        (
            with_changes(torch_autocast={"enabled": True, "lower_precision_safe_modules": ["torch.nn.Linearr"]}),
            1,
            "torch_autocast.lower_precision_safe_modules.0: torch.nn has no torch module class 'Linearr'",
        ),
        (
            with_changes(torch_autocast={"enabled": True, "lower_precision_safe_modules": [".."]}),
            1,
            "torch_autocast.lower_precision_safe_modules.0: '..' is not package.Class of an importable module",
        ),
        (
            with_changes(torch_autocast={"enabled": True}, parallel={"pipeline_parallel_size": 2}),
            2,
            "torch_autocast.enabled: DeepSpeed's pipeline engine does not autocast its stages",
        ),
        (
            with_changes(
                fp16={"enabled": True}, zero_optimization={"stage": 0}, parallel={"pipeline_parallel_size": 2}
            ),
            2,
            "zero_optimization.stage: ZeRO-0 with fp16 under pipeline parallelism would not scale the loss",
        ),
        (
            with_changes(torch_autocast={"enabled": True}, trainer={"backend": "accelerate"}),
            1,
            "torch_autocast.enabled: torch_autocast is a DeepSpeed section; on the accelerate backend bf16.enabled",
        ),
        (
            with_changes(zero_optimization={"stage": 2, "offload_param": {"device": "cpu"}}),
            1,
            "zero_optimization.offload_param.device: parameter offload needs ZeRO stage 3",
        ),
        (
            with_changes(zero_optimization={"stage": 0, "offload_optimizer": {"device": "cpu"}}),
            1,
            "zero_optimization.offload_optimizer.device: optimizer offload needs ZeRO stage 1, 2 or 3",
        ),
        (
            with_changes(
                optimizer={"type": "SGD"},
                zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                zero_allow_untested_optimizer=True,
            ),
            1,
            "optimizer.type: SGD cannot run under offload_optimizer",
        ),
        (
            with_changes(optimizer={"type": "SGD"}, zero_optimization={"stage": 1}),
            1,
            "zero_allow_untested_optimizer: DeepSpeed runs SGD under ZeRO only",
        ),
        (
            with_changes(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}),
            1,
            'optimizer.params.adam_w_mode: false asks for L2 decay, but type "AdamW" always decouples it',
        ),
        (
            with_changes(trainer={"export": False, "sample_tokens": 10}),
            1,
            "trainer.sample_tokens: the sample is drawn from the export, and trainer.export is false",
        ),
        (
            with_changes(
                scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 50, "total_num_steps": 10}}
            ),
            1,
            "scheduler.params.warmup_num_steps: 50 warm-up steps exceed total_num_steps 10",
        ),
        (
            with_changes(
                scheduler={"type": "WarmupCosineLR", "params": {"warmup_num_steps": 50}}, trainer={"max_steps": 10}
            ),
            1,
            "scheduler.params.warmup_num_steps: 50 warm-up steps exceed total_num_steps 10",
        ),
        (
            with_changes(
                scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 3}},
                trainer={"max_steps": 10},
            ),
            1,
            "scheduler.params.total_num_steps: WarmupDecayLR reaches lr 0 at step 3, so the last 7 of "
            'trainer.max_steps 10 would train nothing; set it to "auto"',
        ),
        (
            with_changes(optimizer={"type": "AdamW", "params": {"betas": [0.9, 0.99, 0.9]}}),
            1,
            'optimizer.params.betas: expected a list of 2 numbers or "auto", got [0.9, 0.99, 0.9]',
        ),
        (with_changes(model__n_head=3), 1, "model.n_head: 3 heads do not divide n_embd 32"),
        (with_changes(data__seq_len=128), 1, "data.seq_len: 128 is longer than model.n_positions 64"),
        (
            with_changes(data__tokenizer="byte", model__vocab_size=100),
            1,
            "model.vocab_size: 100 is smaller than the byte tokenizer's 256",
        ),
        (with_changes(data__tokenizer="gpt2-tokenizer-dir"), 1, "data.tokenizer: 'gpt2-tokenizer-dir' is neither"),
        (with_changes(data__path="no/such/corpus.txt"), 1, "data.path: 'no/such/corpus.txt' does not exist"),
        (with_changes(data__path=["no/such/a.txt"]), 1, "data.path[0]: 'no/such/a.txt' does not exist"),
        (with_changes(data__type="image"), 1, 'data.type: "image" data cannot train a gpt model'),
        (
            {**with_changes(), "model": {"family": "resnet", "preset": "resnet18"}, "data": {"type": "image"}},
            1,
            "data.path: image data needs a path",
        ),
        (
            with_changes(model__init_from="no/such/checkpoint"),
            1,
            "model.init_from: 'no/such/checkpoint' does not exist",
        ),
        (
            with_changes(trainer__resume="no/such/step5"),
            1,
            "trainer.resume: 'no/such/step5' is not a checkpoint directory",
        ),
        (
            with_changes(parallel__pipeline_parallel_size=2, zero_optimization__stage=2),
            2,
            "zero_optimization.stage: ZeRO-2 cannot run with pipeline parallelism",
        ),
        (
            with_changes(parallel__pipeline_parallel_size=2, zero_optimization__stage=3),
            2,
            "zero_optimization.stage: ZeRO-3 cannot run with pipeline parallelism",
        ),
        (
            with_changes(parallel__pipeline_parallel_size=3, model__n_layer=2),
            3,
            "parallel.pipeline_parallel_size: 3 stages for a model of 2 GPT2Block blocks; use at most 2",
        ),
        (
            with_changes(parallel__pipeline_parallel_size=2, model__activation_checkpointing=True),
            2,
            "model.activation_checkpointing: pipeline stages checkpoint by layer interval",
        ),
        (
            with_changes(parallel__pipeline_activation_checkpoint_interval=1),
            1,
            "parallel.pipeline_activation_checkpoint_interval: 1 applies to pipeline stages only",
        ),
        (
            with_changes(parallel__tensor_parallel_size=4),
            4,
            "model.n_head: 2 heads cannot be split across tensor_parallel_size 4",
        ),
        (
            with_changes(parallel__tensor_parallel_size=2, model__vocab_size=65),
            2,
            'model.vocab_size: 65 rows cannot be split across tensor_parallel_size 2; use 66 or "auto"',
        ),
        (
            with_changes(parallel__tensor_parallel_size=2, zero_optimization__stage=3),
            2,
            "zero_optimization.stage: ZeRO-3 does not combine with tensor parallelism",
        ),
        (
            {
                **with_changes(parallel__tensor_parallel_size=2),
                "model": {"family": "resnet", "preset": "resnet18"},
                "data": {"type": "synthetic"},
            },
            2,
            "parallel.tensor_parallel_size: resnet models have no tensor-parallel form",
        ),
        (
            {
                **with_changes(parallel__pipeline_parallel_size=9),
                "model": {"family": "resnet", "preset": "resnet18"},
                "data": {"type": "synthetic"},
            },
            9,
            "parallel.pipeline_parallel_size: 9 stages for a model of 8 BasicBlock blocks",
        ),
        (with_changes(parallel__pipeline_parallel_size=2), 3, "parallel: world size 3 is not divisible by"),
        (
            {
                **with_changes(train_micro_batch_size_per_gpu=1, train_batch_size=1),
                "model": {"family": "resnet", "preset": "resnet18"},
                "data": {"type": "synthetic", "image_size": 32},
            },
            1,
            "train_micro_batch_size_per_gpu: 1 image of 32 pixels leaves ResNet's BatchNorm one value",
        ),
    ],
)
def test_rules_name_the_path_and_the_fix(document: dict, world_size: int, expected: str):
    messages = issues_of(document, world_size)
    assert any(message.startswith(expected) for message in messages), messages


def test_a_torchvision_resnet_is_refused_where_torchvision_does_not_import():
    document = {
        "train_micro_batch_size_per_gpu": 2,
        "model": {"family": "resnet", "preset": "resnet18", "num_classes": 10, "implementation": "torchvision"},
        "data": {"type": "synthetic", "image_size": 64},
    }
    if torchvision_available():
        assert check_document(document, 1, CPU)["model"]["implementation"] == "torchvision"
    else:
        assert issues_of(document) == [
            'model.implementation: "torchvision", but torchvision does not import here; use "auto" or '
            '"transformers" (same architecture)'
        ]


def test_hardware_checks_can_be_skipped_for_another_machine():
    document = with_changes(fp16={"enabled": True}, zero_optimization={"stage": 1})
    assert check_document(document, 8, None)["fp16"]["enabled"] is True
    assert check_document(document, 8, GPU)["fp16"]["enabled"] is True


@pytest.mark.parametrize(
    "train,micro,accum,dp,expected",
    [
        (32, None, None, 4, (32, 8, 1)),
        (None, 4, None, 2, (8, 4, 1)),
        (None, 4, 3, 2, (24, 4, 3)),
        (32, 2, None, 4, (32, 2, 4)),
        (32, None, 2, 4, (32, 4, 2)),
        (24, 4, 3, 2, (24, 4, 3)),
    ],
)
def test_batch_triple_is_solved_like_deepspeed(train, micro, accum, dp, expected):
    triple = solve_batch_triple(train, micro, accum, dp)
    assert (triple.train_batch_size, triple.micro_batch_size, triple.gradient_accumulation_steps) == expected


def test_batch_triple_refuses_what_cannot_be_met():
    with pytest.raises(BatchError, match="use a multiple of 8"):
        solve_batch_triple(30, None, 2, 4)


def test_auto_values_are_resolved_from_engine_settings():
    document = with_changes(
        train_batch_size="auto",
        gradient_accumulation_steps=2,
        gradient_clipping="auto",
        bf16={"enabled": "auto"},
        scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}},
        trainer={"max_steps": 77},
        zero_optimization={"stage": 3},
    )
    on_cpu = resolve(check_document(document, 4, CPU), 4, CPU).document
    assert on_cpu["train_batch_size"] == 2 * 2 * 4
    assert on_cpu["gradient_clipping"] == 1.0
    assert on_cpu["bf16"]["enabled"] is False
    assert on_cpu["optimizer"]["params"]["torch_adam"] is True and on_cpu["optimizer"]["params"]["fused"] is False
    assert on_cpu["scheduler"]["params"]["total_num_steps"] == 77
    assert on_cpu["scheduler"]["params"]["warmup_max_lr"] == on_cpu["optimizer"]["params"]["lr"]
    assert on_cpu["zero_optimization"]["reduce_bucket_size"] == 40_000_000  # Megatron's floor
    assert on_cpu["zero_optimization"]["stage3_prefetch_bucket_size"] == 50_000_000
    assert on_cpu["zero_optimization"]["stage3_param_persistence_threshold"] == 320
    assert on_cpu["data"]["seq_len"] == 64
    assert on_cpu["trainer"]["threads_per_rank"] == 1
    assert on_cpu["trainer"]["peak_tflops"] is None  # no MFU claimed on a CPU
    on_gpu = resolve(check_document(document, 8, GPU), 8, GPU).document
    assert on_gpu["bf16"]["enabled"] is True
    assert on_gpu["optimizer"]["params"]["torch_adam"] is True  # no compiler needed (docs/design/config.md)
    assert on_gpu["optimizer"]["params"]["fused"] is True  # torch's fused AdamW, one launch per step
    assert on_gpu["trainer"]["peak_tflops"] == pytest.approx(989.5)  # H100 SXM, dense bf16


def test_torch_autocast_turns_auto_precisions_off_and_counts_bf16_products():
    """Autocast is the run's mixed precision: bf16/fp16 "auto" stay off, the weights (and the
    planner's model states) are fp32, while MFU's peak and activations are bf16's."""
    document = with_changes(bf16={"enabled": "auto"}, fp16={"enabled": "auto"}, torch_autocast={"enabled": True})
    config = resolve(check_document(document, 8, GPU), 8, GPU)
    assert config.document["bf16"]["enabled"] is False and config.document["fp16"]["enabled"] is False
    assert (config.precision, config.compute_precision) == ("fp32", "bf16")
    assert config.document["trainer"]["peak_tflops"] == pytest.approx(989.5)  # H100 SXM, dense bf16
    autocast = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}  # fp32 reduction
    assert config.deepspeed_config()["torch_autocast"] == autocast


def test_deepspeed_config_holds_only_deepspeed_keys():
    config = resolve(check_document(copy.deepcopy(BASE), 1, CPU), 1, CPU)
    ds = config.deepspeed_config()
    assert not {"model", "data", "trainer", "parallel"} & set(ds)
    assert ds["gradient_clipping"] == 1.0 and ds["train_batch_size"] == 2


@pytest.mark.parametrize(
    "assignment,path,value",
    [
        ("trainer.max_steps=50", ("trainer", "max_steps"), 50),
        ("gradient_clipping=0.5", ("gradient_clipping",), 0.5),
        ("bf16.enabled=auto", ("bf16", "enabled"), "auto"),
        ("bf16.enabled=true", ("bf16", "enabled"), True),
        ("trainer.resume=true", ("trainer", "resume"), True),
        ("trainer.resume=runs/x/checkpoints/step5", ("trainer", "resume"), "runs/x/checkpoints/step5"),
        ("data.path=null", ("data", "path"), None),
        ("optimizer.params.betas=[0.9, 0.95]", ("optimizer", "params", "betas"), [0.9, 0.95]),
        ("model.n_layer=3", ("model", "n_layer"), 3),
        ("trainer.max_steps=1e3", ("trainer", "max_steps"), 1000),
        ("zero_optimization.reduce_bucket_size=5e8", ("zero_optimization", "reduce_bucket_size"), 500_000_000),
    ],
)
def test_overrides_are_typed_by_the_schema(assignment: str, path: tuple, value):
    document = copy.deepcopy(BASE)
    assert apply_overrides(document, [assignment]) == []
    target = document
    for key in path:
        target = target[key]
    assert target == value


@pytest.mark.parametrize(
    "assignment,expected",
    [
        ("trainer.max_step=5", "trainer.max_step: unknown key 'max_step' in --set (did you mean \"max_steps\"?)"),
        ("zero_optimisation.stage=1", "zero_optimisation.stage: unknown key 'zero_optimisation'"),
        ("trainer.max_steps=many", "trainer.max_steps: --set value 'many': expected integer"),
        ("data.pin_memory=sometimes", "data.pin_memory: --set value 'sometimes': expected boolean or \"auto\""),
        ("trainer.max_steps", "--set trainer.max_steps: expected dotted.path=value"),
        ("trainer.max_steps=2.5", "trainer.max_steps: --set value '2.5': expected integer"),
        ("optimizer.params.lr=nan", "optimizer.params.lr: --set value 'nan': expected number"),
    ],
)
def test_bad_overrides_name_the_path(assignment: str, expected: str):
    issues = apply_overrides(copy.deepcopy(BASE), [assignment])
    assert [str(issue) for issue in issues][0].startswith(expected)


def test_optimizer_names_are_read_in_any_case_as_deepspeed_reads_them():
    filled = check_document(with_changes(optimizer={"type": "adamw", "params": {"lr": 1e-3}}), 1, CPU)
    assert filled["optimizer"]["type"] == "AdamW"
    assert filled["optimizer"]["params"]["betas"] == [0.9, 0.999]  # AdamW's defaults reached it


def test_whole_numbers_written_as_floats_reach_the_run_as_integers():
    """JSON Schema counts 2.0 and 5e8 as integers (DeepSpeed's docs write bucket sizes so); the
    data sampler, the model builder and range() need ints."""
    document = with_changes(train_micro_batch_size_per_gpu=2.0, model__n_layer=2.0)
    document["zero_optimization"] = {"stage": 2, "reduce_bucket_size": 5e8}
    filled = check_document(document, 1, CPU)
    values = [filled["train_micro_batch_size_per_gpu"], filled["model"]["n_layer"]]
    values.append(filled["zero_optimization"]["reduce_bucket_size"])
    assert values == [2, 2, 500_000_000]
    assert all(type(value) is int for value in values)


def test_bad_files_are_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.json", world_size=1, hardware=CPU)
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": {"family": "gpt"}')
    with pytest.raises(ConfigError, match=r"broken.json: invalid JSON \(hjson\) at line 1"):
        load_config(broken, world_size=1, hardware=CPU)
    with pytest.raises(ConfigError, match="is a directory, not a JSON config file"):
        load_config(tmp_path, world_size=1, hardware=CPU)
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"data": {"path": "café"}}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin.json: not UTF-8 text \(byte 22\)"):
        load_config(latin, world_size=1, hardware=CPU)


def test_an_output_dir_that_is_a_file_is_refused(tmp_path: Path):
    (tmp_path / "taken").touch()
    assert issues_of(with_changes(trainer__output_dir=str(tmp_path / "taken"))) == [
        f"trainer.output_dir: '{tmp_path / 'taken'}' is a file; the run needs a directory there"
    ]
    assert issues_of(with_changes(trainer__output_dir=str(tmp_path / "taken" / "run" / "1"))) == [
        f"trainer.output_dir: '{tmp_path / 'taken'}' is a file, so '{tmp_path / 'taken' / 'run' / '1'}' cannot be "
        "made; the run needs a directory there"
    ]


def test_a_key_given_twice_is_refused_with_its_path(tmp_path: Path):
    """hjson and Python's JSON reader keep the last of two equal keys, where DeepSpeed refuses them:
    a second "trainer" block would silently drop the first's output_dir and everything else in it."""
    config = tmp_path / "twice.json"
    config.write_text('{"trainer": {"max_steps": 3}, "optimizer": {"params": {"lr": 1, "lr": 2}}, "trainer": {}}')
    with pytest.raises(ConfigError) as caught:
        load_config(config, world_size=1, hardware=CPU)
    assert [str(issue) for issue in caught.value.issues] == [
        "optimizer.params.lr: given twice in one object, which DeepSpeed refuses; merge them",
        "trainer: given twice in one object, which DeepSpeed refuses; merge them",
    ]


def test_config_reference_is_generated_from_the_schema():
    committed = (ROOT / "docs" / "config_reference.md").read_text()
    assert committed == render_reference(), "docs/config_reference.md is stale: run `python -m engine docs`"
    for key in ("zero_optimization.offload_param.device", "model.n_head", "trainer.resume", "data.seq_len"):
        assert f"`{key}`" in committed


def test_fp16_auto_on_an_fp16_only_gpu_is_refused_under_zero0_pipeline_stages():
    """HF's `"fp16": {"enabled": "auto"}` on a V100 or T4 resolves to fp16, which ZeRO-0 pipeline
    stages would train unscaled: refused before resolving, as fp16 written out is."""
    v100 = Hardware("cuda", bf16_supported=False, fp16_supported=True, cpu_count=8, local_world_size=2, name="V100")
    document = with_changes(
        fp16={"enabled": "auto"}, zero_optimization={"stage": 0}, parallel={"pipeline_parallel_size": 2}
    )
    messages = issues_of(document, 2, v100)
    assert any(m.startswith("zero_optimization.stage: ZeRO-0 with fp16 under pipeline parallelism") for m in messages)
    document["zero_optimization"]["stage"] = 1
    assert resolve(check_document(document, 2, v100), 2, v100).document["fp16"]["enabled"] is True
