"""`python -m bench.trl_sft --config CONFIG [--set PATH=VALUE ...]`: TRL's `SFTTrainer`, the field's own
fine-tuning tool, on the recipe of an engine config, in a process of its own (the `sft` benchmark's
baseline).

The recipe is read from the config as the engine resolves it, so the two cannot drift apart: the
base directory (`model.init_from`) loaded by `AutoModelForCausalLM`, peft's LoRA as the engine
configures it (models/lora.py), the same conversations (the training part the engine keeps: all but
its last `data.validation_fraction`), `data.seq_len` as TRL's `max_length`, the micro-batch,
accumulation, seed and step count, AdamW with the engine's learning rate, betas, epsilon, weight
decay and clipping at a constant rate (no schedule), fp32, no activation checkpointing (TRL's default
is on), logging at `trainer.log_interval`. What either side cannot share is refused here, by name.

Packing: TRL's own, best-fit decreasing (`packing_strategy="bfd"`), which runs padding-free (the
micro-batch's windows flattened into one row with positions restarting at each conversation) as the
engine's windows are masked: no conversation attends to another. The engine fills its windows
greedily in file order and pads their tails, so the two hold the same conversations in windows of
different fill; the benchmark counts conversation tokens on both sides.

Assistant-only loss: TRL finds what trains from `{% generation %}` blocks in the template. The
engine's ChatML has none; `GENERATION_CHATML` renders the same text with the block around what the
engine trains on (each assistant turn's content, `<|im_end|>` and the newline after it), and every
conversation is checked to render alike under both before training.

Writes <output_dir>/trl.json: at each logged step the wall clock, the training loss and TRL's count
of tokens trained so far (`num_tokens`), and the machine's facts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TRL_RESULT = "trl.json"

# The tiny Llama's ChatML (bench/tiny_llama.py's CHATML_TEMPLATE) with TRL's
# generation block around what the engine trains on in an assistant turn.
GENERATION_CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def sft_arguments(document: Mapping[str, Any]) -> dict[str, Any]:
    """`SFTConfig`'s arguments for the engine's resolved config `document`; ValueError naming the
    setting where the engine would train something TRL is not told to."""
    data, trainer, optimizer = document["data"], document["trainer"], document["optimizer"]
    params = optimizer.get("params", {})
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false (engine/backends/optim.py).
    adamw = optimizer["type"] == "AdamW" or (optimizer["type"] == "Adam" and params.get("adam_w_mode", True))
    refusals = [
        (document.get("scheduler"), "scheduler: the comparison runs at a constant learning rate"),
        (not adamw, f"optimizer.type: {optimizer['type']} (TRL is given AdamW)"),
        (_reduced_precision(document), "bf16, fp16, torch_autocast: fp32 only"),
        (
            trainer["weight_decay_on"] != "matrices",
            'trainer.weight_decay_on: "matrices" only, as transformers\' Trainer exempts biases and norms',
        ),
        (document["model"].get("activation_checkpointing"), "model.activation_checkpointing: off only"),
        (document["model"].get("dropout"), "model.dropout: 0 only, as the base directory has it"),
        (data["type"] != "chat", f"data.type: {data['type']} (chat only)"),
        (data["chat_template"] is not None, "data.chat_template: the base tokenizer's own template only"),
        (
            not (data["path"] is None or str(data["path"]).endswith(".jsonl")),
            "data.path: the chat sample (null) or one .jsonl file",
        ),
        (data["validation_path"] is not None, "data.validation_path: null only (data.validation_fraction holds out)"),
    ]
    problems = [message for refused, message in refusals if refused]
    if problems:
        raise ValueError("the TRL baseline cannot follow " + "; ".join(problems))
    betas = params.get("betas", (0.9, 0.999))
    packing = data["packing"]
    return {
        "output_dir": trainer["output_dir"],
        "max_steps": trainer["max_steps"],
        "logging_steps": trainer["log_interval"],
        "seed": trainer["seed"],
        "per_device_train_batch_size": document["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": document["gradient_accumulation_steps"],
        "learning_rate": params["lr"],
        "adam_beta1": betas[0],
        "adam_beta2": betas[1],
        "adam_epsilon": params.get("eps", 1e-8),
        "weight_decay": params.get("weight_decay", 0.0),
        "optim": "adamw_torch_fused" if params.get("fused") else "adamw_torch",
        "max_grad_norm": document.get("gradient_clipping") or 0.0,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "bf16": False,
        "fp16": False,
        "activation_checkpointing": False,
        "max_length": data["seq_len"],
        "packing": packing,
        "packing_strategy": "bfd",
        # Unpacked, the engine pads a micro-batch to its longest conversation rounded up to 8 (data/chat/samples.py).
        "pad_to_multiple_of": None if packing else 8,
        "assistant_only_loss": data["train_on"] == "assistant",
        "dataloader_num_workers": data["num_workers"],
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def _reduced_precision(document: Mapping[str, Any]) -> bool:
    return any(document.get(section, {}).get("enabled") is True for section in ("bf16", "fp16", "torch_autocast"))


def training_records(path: Path, validation_fraction: float) -> list[dict[str, Any]]:
    """The records of a JSON Lines file that the engine trains on: all but the last
    `validation_fraction`, as data/kinds/chat.py holds them out."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return records[: int(len(records) * (1 - validation_fraction))]


def check_same_text(tokenizer: Any, template: str, records: list[dict[str, Any]]) -> None:
    """Every conversation renders to the same text under the engine's template and under `template`:
    the marked template changes what trains, never what the model reads."""
    for number, record in enumerate(records, start=1):
        ours = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        theirs = tokenizer.apply_chat_template(record["messages"], tokenize=False, chat_template=template)
        if ours != theirs:
            raise ValueError(
                f"record {number}: the generation-marked template renders it differently from the tokenizer's own; "
                "the TRL baseline knows ChatML only"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trl_sft", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from data.corpus import CHAT_SAMPLE
    from engine.config import ConfigError, load_config
    from engine.launch.hardware import detect_hardware

    try:
        config = load_config(args.config, args.overrides, world_size=1, hardware=detect_hardware(local_world_size=1))
        document = config.document
        arguments = sft_arguments(document)
        tokenizer = AutoTokenizer.from_pretrained(document["model"]["init_from"])
        data = document["data"]
        records = training_records(Path(data["path"] or CHAT_SAMPLE), data["validation_fraction"])
        check_same_text(tokenizer, GENERATION_CHATML, records)
    except (ConfigError, ValueError) as error:
        parser.exit(2, f"{error}\n")
    torch.set_num_threads(document["trainer"]["threads_per_rank"])
    tokenizer.chat_template = GENERATION_CHATML
    result = train(document, arguments, tokenizer, records)
    (Path(arguments["output_dir"]) / TRL_RESULT).write_text(json.dumps(result) + "\n")
    return 0


def train(document: Mapping[str, Any], arguments: dict[str, Any], tokenizer: Any, records: list[dict]) -> dict:
    """TRL's run of the recipe: each logged step's wall clock, loss and tokens so far."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from bench.machine import machine_facts
    from models.lora import lora_config

    model_section = document["model"]
    model = AutoModelForCausalLM.from_pretrained(
        model_section["init_from"], dtype=torch.float32, attn_implementation=model_section["attn_implementation"]
    )
    logged: list[tuple[int, float, float, int]] = []

    class Clock(TrainerCallback):
        """The wall clock at each logged step, after the step's log: what the engine's metrics record holds."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append((state.global_step, time.time(), logs["loss"], int(logs["num_tokens"])))

    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**arguments),
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=tokenizer,
        # The engine's own translation of model.lora into peft's LoraConfig, so both adapt the same layers alike.
        peft_config=lora_config(model_section["lora"]),
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "steps": [step for step, *_ in logged],
        "times": [at for _, at, _, _ in logged],
        "losses": [loss for _, _, loss, _ in logged],
        "tokens": [tokens for *_, tokens in logged],
        "machine": machine_facts(torch.get_num_threads()),
    }


if __name__ == "__main__":
    sys.exit(main())
