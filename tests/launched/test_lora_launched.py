"""LoRA in real launches on 2 gloo ranks: the tiny Llama that transformers wrote (model.init_from)
fine-tuned with adapters on q_proj and v_proj on the project's chat sample (packed, rendered with the
base's chat template), against one process that trains the same batches with plain transformers,
peft and torch's AdamW. Under ZeRO-2 and ZeRO-3 (parameters and optimizer offloaded), DDP and FSDP2:
the losses and the trained adapters within 1e-5; a checkpoint holds the adapters and their optimizer
states alone, and the planned bytes (the frozen base as parameters alone) are the measured ones; the
exported adapter, loaded by `PeftModel.from_pretrained` on the base, and the merged export, loaded by
`AutoModelForCausalLM`, give the reference's logits; the tokenizer is saved with its chat template,
and the end-of-run sample answers a validation conversation through it; a resume from a mid-run
checkpoint is bit-exact."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from data.corpus import CHAT_SAMPLE
from data.loader import make_train_loader
from engine.backends.optim import build_optimizer
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import load_data
from models.labels import IGNORE_INDEX
from tests.support.launch import Run, launch, launch_accelerate
from tests.support.memory import assert_plan_matches_measured
from tests.support.pretrained import CHATML_TEMPLATE, write_tiny_llama

TOLERANCE = 1e-5
STEPS = 4
TARGETS = ["q_proj", "v_proj"]
# Every ZeRO-3 parameter partitioned, the adapters too: under the resolved threshold (10 x the
# width, 640 elements) the adapters (512 and 256 elements) would stay whole on every rank, and with
# DeepSpeed's default (100,000) every parameter of this model would, and nothing would be gathered.
ZERO2 = {"zero_optimization.stage": 2}
ZERO3 = {
    "zero_optimization.stage": 3,
    "zero_optimization.stage3_param_persistence_threshold": 0,
    "zero_optimization.offload_param.device": "cpu",
    "zero_optimization.offload_optimizer.device": "cpu",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def config(base: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """configs/llama_tiny.json fine-tuning `base` (its directory decides the architecture and the
    tokenizer) with LoRA r 8 on the attention's query and value projections, on the chat sample."""
    document = json.loads(Path("configs/llama_tiny.json").read_text())
    document["model"] = {"family": "llama", "init_from": str(base), "lora": {"r": 8, "target_modules": TARGETS}}
    document["data"] = {"type": "chat", "path": None, "seq_len": 256, "packing": True}
    document["trainer"].update({"max_steps": STEPS, "save_interval": 2})
    path = tmp_path_factory.mktemp("config") / "lora.json"
    path.write_text(json.dumps(document))
    return str(path)


@dataclass
class Reference:
    model: PeftModel
    losses: list[float]


def reference(config: str, base: Path, overrides: dict[str, object], cpu_adam: bool = False) -> Reference:
    """One process training the run's batches: every rank's micro-batches of a step, each packed
    conversation run alone, with plain transformers and peft; the loss is the step's summed token loss
    over its target tokens. torch's AdamW steps the adapters, or DeepSpeed's CPU Adam where the run
    offloads the optimizer (DeepSpeed's host optimizer, whose arithmetic differs from torch's in the
    last bit: the comparison measures what ZeRO does, not two Adam kernels)."""
    sets = [f"{key}={value}" for key, value in overrides.items()]
    resolved = load_config(config, sets, world_size=2, hardware=detect_hardware(local_world_size=2))
    document, seed = resolved.document, resolved.trainer.seed
    torch.set_num_threads(resolved.trainer.threads_per_rank)
    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)  # the adapters' draw, which the engine makes from the seed alone
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(document["optimizer"], [{"params": trainable}], cpu_adam=cpu_adam)
    dataset = load_data(resolved).train
    loaders = [
        make_train_loader(dataset, micro_batch_size=2, grad_accum=1, dp_rank=rank, dp_size=2, seed=seed)
        for rank in range(2)
    ]
    losses = []
    for _ in range(STEPS):
        batches = [next(loader) for loader in loaders]
        targets = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)
        total = 0.0
        for ids, labels in conversations(batches):
            summed = F.cross_entropy(model(input_ids=ids[None]).logits[0].float(), labels, reduction="sum")
            (summed / targets).backward()
            total += summed.item()
        losses.append(total / targets)
        torch.nn.utils.clip_grad_norm_(trainable, document["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return Reference(model.eval(), losses)


def conversations(batches: list[dict[str, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (ids, labels) of every conversation packed in `batches`, cut where the positions restart,
    leaving out the windows' padding, which holds no target."""
    found = []
    for batch in batches:
        for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"], strict=True):
            starts = [*torch.nonzero(positions == 0).flatten().tolist(), len(positions)]
            for start, end in zip(starts[:-1], starts[1:], strict=True):
                if (labels[start:end] != IGNORE_INDEX).any():
                    found.append((ids[start:end], labels[start:end]))
    return found


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.arange(60).reshape(2, 30) * 5).logits


def assert_losses_match(run: Run, expected: Reference) -> None:
    assert len(run.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(run.losses, expected.losses, strict=True)) <= TOLERANCE, (
        run.losses,
        expected.losses,
    )


def assert_adapter_matches(adapter: dict[str, torch.Tensor], expected: Reference) -> None:
    """The exported adapter holds peft's own names for the reference's trained tensors, within 1e-5."""
    wanted = get_peft_model_state_dict(expected.model)
    assert adapter.keys() == wanted.keys()
    for name, tensor in adapter.items():
        torch.testing.assert_close(tensor, wanted[name], rtol=0, atol=TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def zero2(config: str, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch(config, {**ZERO2, "trainer.sample_tokens": 8}, tmp_path_factory.mktemp("zero2"))


@pytest.fixture(scope="module")
def zero3(config: str, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch(config, {**ZERO3, "trainer.export_merge_lora": True}, tmp_path_factory.mktemp("zero3"))


@pytest.fixture(scope="module")
def adam_reference(config: str, base: Path) -> Reference:
    return reference(config, base, {})


@pytest.mark.launch
def test_zero2_trains_the_adapters_alone_and_exports_what_peft_loads(
    zero2: Run, adam_reference: Reference, config: str, base: Path
):
    assert_losses_match(zero2, adam_reference)
    export = zero2.output_dir / "export"
    assert_adapter_matches(load_file(export / "adapter_model.safetensors"), adam_reference)
    saved = json.loads((export / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base) and saved["target_modules"] is not None
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), export).eval()
    torch.testing.assert_close(logits(loaded), logits(adam_reference.model), rtol=0, atol=TOLERANCE)
    # The tokenizer, with the base's chat template, beside the adapter.
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML_TEMPLATE
    # The checkpoint: the adapters' weights and optimizer partitions, nothing of the frozen base.
    trainable = sum(tensor.numel() for tensor in get_peft_model_state_dict(adam_reference.model).values())
    tag = zero2.output_dir / "checkpoints" / f"step{STEPS:08d}"
    module = torch.load(tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    assert module and all(".lora_" in name for name in module), sorted(module)
    partitions = [
        torch.load(tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)["optimizer_state_dict"]
        for rank in range(2)
    ]
    held = sum(group.numel() for part in partitions for group in part["single_partition_of_fp32_groups"])
    assert held == trainable  # 3,584 elements: already a multiple of ZeRO's alignment
    assert_plan_matches_measured(zero2, config, ZERO2, world_size=2)


@pytest.mark.launch
def test_the_end_of_run_sample_answers_a_validation_conversation_through_its_template(
    zero2: Run, config: str, base: Path
):
    """The sample's prompt is the first validation conversation (the chat sample's last
    data.validation_fraction) up to its last answer, as transformers renders it for inference: the
    template with the assistant's turn opened."""
    resolved = load_config(config, [], world_size=2, hardware=detect_hardware(local_world_size=2))
    records = [json.loads(line) for line in CHAT_SAMPLE.read_text().splitlines()]
    messages = records[int(len(records) * (1 - resolved.data.validation_fraction))]["messages"]
    last_answer = max(index for index, message in enumerate(messages) if message["role"] == "assistant")
    tokenizer = AutoTokenizer.from_pretrained(base)
    prompt = tokenizer.apply_chat_template(messages[:last_answer], add_generation_prompt=True, tokenize=False)
    heading = "sample, the reply to the first validation conversation"
    assert heading in zero2.stdout
    assert f"(rendered through the chat template up to its last answer):\n{prompt}" in zero2.stdout


@pytest.mark.launch
def test_zero3_with_offload_trains_as_one_process_and_exports_the_merged_model(zero3: Run, config: str, base: Path):
    expected = reference(config, base, ZERO3, cpu_adam=True)
    assert_losses_match(zero3, expected)
    export = zero3.output_dir / "export"
    assert not (export / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(export).eval()
    torch.testing.assert_close(logits(merged), logits(expected.model), rtol=0, atol=TOLERANCE)
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML_TEMPLATE
    assert_plan_matches_measured(zero3, config, {**ZERO3, "trainer.export_merge_lora": True}, world_size=2)


@pytest.mark.launch
def test_a_zero3_lora_run_resumes_exactly(zero3: Run, config: str, tmp_path: Path):
    """Resumed from the step-2 checkpoint of the uninterrupted run: the frozen base comes again from
    model.init_from, the adapters and their optimizer states from the checkpoint, and steps 3 and 4
    and the export are the uninterrupted run's, bit for bit."""
    checkpoint = zero3.output_dir / "checkpoints" / "step00000002"
    resumed = launch(config, {**ZERO3, "trainer.export_merge_lora": True, "trainer.resume": str(checkpoint)}, tmp_path)
    assert [record["step"] for record in resumed.records] == [3, 4]
    assert resumed.losses == zero3.losses[2:]
    final, expected = resumed.exported_state_dict(), zero3.exported_state_dict()
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name


@pytest.fixture(scope="module")
def fsdp2(config: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return launch_accelerate(config, {"zero_optimization.stage": 3}, tmp_path_factory.mktemp("fsdp2"))


@pytest.mark.launch
@pytest.mark.parametrize("stage", [0, 3], ids=["ddp", "fsdp2"])
def test_the_accelerate_backend_trains_the_adapters_as_one_process(
    stage: int, adam_reference: Reference, config: str, request: pytest.FixtureRequest
):
    overrides = {"zero_optimization.stage": stage}
    if stage == 3:
        run = request.getfixturevalue("fsdp2")
    else:
        run = launch_accelerate(config, overrides, request.getfixturevalue("tmp_path"))
    assert_losses_match(run, adam_reference)
    assert_adapter_matches(load_file(run.output_dir / "export" / "adapter_model.safetensors"), adam_reference)
    assert_plan_matches_measured(run, config, {**overrides, "trainer.backend": "accelerate"}, world_size=2)


@pytest.mark.launch
def test_an_fsdp2_lora_run_resumes_exactly(fsdp2: Run, config: str, tmp_path: Path):
    """torch's distributed checkpoint of the adapters alone (ignore_frozen_params), loaded without the
    frozen base's names: the steps after it and the adapter, bit for bit."""
    checkpoint = fsdp2.output_dir / "checkpoints" / "step00000002"
    assert not any(".lora_" not in key for key in torch_checkpoint_keys(checkpoint, "model."))
    resumed = launch_accelerate(config, {"zero_optimization.stage": 3, "trainer.resume": str(checkpoint)}, tmp_path)
    assert [record["step"] for record in resumed.records] == [3, 4]
    assert resumed.losses == fsdp2.losses[2:]
    final = load_file(resumed.output_dir / "export" / "adapter_model.safetensors")
    expected = load_file(fsdp2.output_dir / "export" / "adapter_model.safetensors")
    assert final.keys() == expected.keys()
    for name in final:
        assert torch.equal(final[name], expected[name]), name


def torch_checkpoint_keys(checkpoint: Path, prefix: str) -> list[str]:
    """The names under `prefix` that a torch distributed checkpoint holds."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    found = [key for key in keys if key.startswith(prefix)]
    assert found, sorted(keys)[:5]
    return found
