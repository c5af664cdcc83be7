"""Chat and instruction data (data/chat/, data/kinds/chat.py): the loss mask against one written by
hand, the formats read alike, packing against the same conversations alone in a transformers-written
Llama (logits and summed loss), the token cache reused, and each bad input refused with one message
naming its file and record, before any process group."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
import torch.nn.functional as F

from data import build_datasets
from data.chat.sample import render_sample
from data.corpus import CHAT_SAMPLE
from data.kinds import KINDS
from data.loader import make_train_loader
from engine.config import ConfigError, load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import RunError, load_data
from models.labels import IGNORE_INDEX
from tests.support.launch import ROOT
from tests.support.pretrained import CHATML_TEMPLATE, write_chat_tokenizer, write_tiny_llama

CONFIG = ROOT / "configs" / "sft_llama_tiny.json"
SEQ_LEN = 256  # the tiny Llama's max_position_embeddings
BYTES = 512  # more than the chat sample's longest conversation in bytes under ChatML (389)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def plain_tokenizer_dir(tmp_path_factory) -> Path:
    return write_chat_tokenizer(tmp_path_factory.mktemp("plain_tokenizer"), template=None)


def section(**changes) -> dict:
    """A resolved data section of chat data: the byte tokenizer with ChatML, unless changed."""
    return {
        "type": "chat",
        "path": None,
        "validation_path": None,
        "tokenizer": "byte",
        "chat_template": CHATML_TEMPLATE,
        "train_on": "assistant",
        "packing": False,
        "excess_length_strategy": "raise",
        "validation_fraction": 0.1,
        "cache_dir": "auto",
        "prompt_field": "prompt",
        "completion_field": "completion",
        **changes,
    }


def build(data: dict, seq_len: int = BYTES):
    return build_datasets(data, samples="tokens", seed=0, seq_len=seq_len, vocab_size=None, num_classes=None)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def sample_records(count: int) -> list[dict]:
    return [json.loads(line) for line in CHAT_SAMPLE.read_text().splitlines()[:count]]


def test_the_mask_of_a_two_turn_conversation_is_the_assistants_answers_and_their_ends(tmp_path, llama_dir):
    """ChatML through the tiny Llama's own tokenizer: targets are each answer and the `<|im_end|>` and
    newline after it, nothing of the prompts, headers or system turn; labels are shifted one on."""
    from transformers import AutoTokenizer

    conversation = [
        turn("system", "Answer in verse."),
        turn("user", "Who makes the summer?"),
        turn("assistant", "Thy eternal summer shall not fade."),
        turn("user", "And then?"),
        turn("assistant", "Nor lose possession of that fair thou ow'st."),
    ]
    path = write_jsonl(tmp_path / "two_turns.jsonl", [{"messages": conversation}] * 2)
    data = section(path=str(path), validation_path=str(path), tokenizer=str(llama_dir), chat_template=None)
    sample = build(data, SEQ_LEN).train[0]

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    pieces = [
        ("<|im_start|>system\nAnswer in verse.<|im_end|>\n<|im_start|>user\nWho makes the summer?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("Thy eternal summer shall not fade.<|im_end|>\n", True),
        ("<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n", False),
        ("Nor lose possession of that fair thou ow'st.<|im_end|>\n", True),
    ]
    ids, trained = [], []
    for text, target in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        trained += [target] * len(piece)
    expected = [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]
    assert sample["input_ids"].tolist() == ids
    assert sample["labels"].tolist() == expected
    assert "position_ids" not in sample  # unpacked: the model's own causal attention, no explicit mask
    assert ids == tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)


def test_instruction_pairs_are_a_user_turn_and_an_assistant_turn(tmp_path):
    pairs = [{"question": f"Line {i} of the sonnet?", "answer": f"It is line {i}."} for i in range(10)]
    instruction = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [turn("user", p["question"]), turn("assistant", p["answer"])]} for p in pairs],
    )
    fields = {"prompt_field": "question", "completion_field": "answer"}
    left = build(section(type="instruction", path=str(instruction), **fields))
    right = build(section(path=str(chat)))
    assert_same_samples(left.train, right.train)
    assert_same_samples(left.validation, right.validation)


def test_train_on_all_makes_every_next_token_a_target():
    sample = build(section(train_on="all")).train[3]
    ids, labels = sample["input_ids"], sample["labels"]
    assert torch.equal(labels[:-1], ids[1:]) and labels[-1] == IGNORE_INDEX
    masked = build(section()).train[3]
    assert torch.equal(masked["input_ids"], ids) and (masked["labels"] != IGNORE_INDEX).sum() < len(ids) - 1


def test_the_formats_read_alike(tmp_path):
    """JSON (a list of records), parquet and a save_to_disk folder give the samples JSONL gives."""
    records = sample_records(30)
    jsonl = write_jsonl(tmp_path / "chat.jsonl", records)
    listed = tmp_path / "chat.json"
    listed.write_text(json.dumps(records))
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "chat.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    reference = build(section(path=str(jsonl)))
    for path in (listed, tmp_path / "chat.parquet", tmp_path / "saved"):
        other = build(section(path=str(path)))
        assert_same_samples(other.train, reference.train)
        assert_same_samples(other.validation, reference.validation)


def test_the_token_cache_is_built_once_and_keyed_by_the_template_and_targets(tmp_path, capsys):
    data = section(cache_dir=str(tmp_path / "cache"))
    first = build(data)
    assert "data: tokenizing the conversations" in capsys.readouterr().out
    again = build(data)
    assert "data: tokenizing" not in capsys.readouterr().out
    assert_same_samples(again.train, first.train)
    build({**data, "train_on": "all"})
    build({**data, "chat_template": CHATML_TEMPLATE.replace("<|im_end|>", "<|end|>")})
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 3


def test_packing_fills_windows_with_whole_conversations_and_pads_the_tail():
    packed = build(section(packing=True), seq_len=1024).train
    alone = build(section()).train
    member = 0
    for index in range(3):
        window = packed[index]
        assert all(len(tensor) == 1024 for tensor in window.values())
        offset = 0
        for _ in range(int(packed.windows[index + 1] - packed.windows[index])):
            sample = alone[member]
            length = len(sample["input_ids"])
            for key in ("input_ids", "labels"):
                assert torch.equal(window[key][offset : offset + length], sample[key])
            assert window["position_ids"][offset : offset + length].tolist() == list(range(length))
            offset, member = offset + length, member + 1
        assert (window["labels"][offset:] == IGNORE_INDEX).all()
        assert window["position_ids"][offset:].tolist() == list(range(1024 - offset))


def test_a_micro_batch_of_conversations_is_padded_to_a_multiple_of_8():
    train = build(section()).train
    # Three conversations whose longest is no multiple of 8.
    start = next(i for i in range(len(train)) if max(len(train[i + k]["input_ids"]) for k in range(3)) % 8)
    samples = [train[start + k] for k in range(3)]
    lengths = [len(sample["input_ids"]) for sample in samples]
    batch = train.collate(samples)
    width = -(-max(lengths) // 8) * 8
    assert batch["input_ids"].shape == (3, width) and width <= BYTES and max(lengths) % 8
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        assert torch.equal(batch["input_ids"][row, :length], sample["input_ids"])
        assert torch.equal(batch["labels"][row, :length], sample["labels"])
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
    loaded = next(make_train_loader(train, micro_batch_size=4, grad_accum=1, dp_rank=0, dp_size=1, seed=0))
    assert set(loaded) == {"input_ids", "labels"} and loaded["input_ids"].shape[1] % 8 == 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_conversations_logits_equal_its_logits_alone(llama_dir, attention: str):
    """Conversations before it in the window, positions restarting, no attention mask: transformers
    builds the block-diagonal causal mask from the position ids. Without them the window is one
    sequence, and the same logits differ: the comparison can see cross-talk."""
    from transformers import LlamaForCausalLM

    data = section(tokenizer=str(llama_dir), chat_template=None)
    packed = build({**data, "packing": True}, SEQ_LEN).train
    alone = build(data, SEQ_LEN).train
    index = next(w for w in range(len(packed)) if packed.windows[w + 1] - packed.windows[w] >= 2)
    window = packed[index]
    model = LlamaForCausalLM.from_pretrained(llama_dir, attn_implementation=attention).eval()
    with torch.no_grad():
        # No KV cache, as training runs: transformers reads packed position ids only without one.
        logits = model(input_ids=window["input_ids"][None], position_ids=window["position_ids"][None], use_cache=False)
        logits = logits.logits[0]
        crossed = model(input_ids=window["input_ids"][None], use_cache=False).logits[0]
        offset = 0
        for member in range(int(packed.windows[index]), int(packed.windows[index + 1])):
            sample = alone[member]
            length = len(sample["input_ids"])
            assert torch.equal(window["input_ids"][offset : offset + length], sample["input_ids"])
            own = model(input_ids=sample["input_ids"][None], use_cache=False).logits[0]
            torch.testing.assert_close(logits[offset : offset + length], own, atol=1e-5, rtol=0)
            if offset:
                assert (crossed[offset : offset + length] - own).abs().max() > 1e-3
            offset += length


def test_packed_and_unpacked_batches_sum_the_same_loss_over_the_same_targets(llama_dir):
    from transformers import LlamaForCausalLM

    data = section(tokenizer=str(llama_dir), chat_template=None)
    model = LlamaForCausalLM.from_pretrained(llama_dir).eval()
    sums = []
    for packing in (True, False):
        validation = build({**data, "packing": packing}, SEQ_LEN).validation
        samples = [validation[index] for index in range(len(validation))]
        batch = (
            validation.collate(samples) if hasattr(validation, "collate") else torch.utils.data.default_collate(samples)
        )
        with torch.no_grad():
            inputs = {key: batch[key] for key in ("input_ids", "position_ids") if key in batch}
            logits = model(**inputs, use_cache=False).logits
        labels = batch["labels"].reshape(-1)
        loss = F.cross_entropy(
            logits.reshape(len(labels), -1).double(), labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        sums.append((float(loss), int((labels != IGNORE_INDEX).sum())))
    (packed_loss, packed_targets), (loss, targets) = sums
    assert packed_targets == targets > 0
    assert packed_loss == pytest.approx(loss, rel=1e-5)


def test_an_overlong_conversation_is_refused_naming_it_or_truncated(tmp_path):
    records = sample_records(20)
    records[6] = {"messages": [turn("user", "Recite it all."), turn("assistant", "Shall I compare thee? " * 40)]}
    path = write_jsonl(tmp_path / "long.jsonl", records)
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(path))} record 7: the conversation is \d+ tokens, longer than data.seq_len 512",
    ):
        build(section(path=str(path)), seq_len=512)
    truncated = build(section(path=str(path), excess_length_strategy="truncate"), seq_len=512)
    assert len(truncated.train[6]["input_ids"]) == 512
    assert len(truncated.train) + len(truncated.validation) == 20


def bad(tmp_path: Path, record: object, **changes) -> str:
    """The one message the second record of a file draws: the first is good."""
    path = write_jsonl(tmp_path / "bad.jsonl", [sample_records(1)[0], record, *sample_records(10)[1:]])
    with pytest.raises(ValueError) as caught:
        build(section(path=str(path), **changes))
    message = str(caught.value)
    assert f"{path} record 2: " in message
    return message


def test_each_bad_record_is_refused_naming_its_file_and_number(tmp_path):
    assert "has no 'messages'" in bad(tmp_path, {"conversation": [turn("user", "hi")]})
    assert "message 1 has no 'role'" in bad(tmp_path, {"messages": [{"content": "hi"}, turn("assistant", "yo")]})
    assert "message 2 has no 'content'" in bad(tmp_path, {"messages": [turn("user", "hi"), {"role": "assistant"}]})
    assert "message 1 has role 'narrator'; roles are system, user, assistant, tool" in bad(
        tmp_path, {"messages": [turn("narrator", "Once"), turn("assistant", "upon")]}
    )
    assert "has no assistant turn" in bad(tmp_path, {"messages": [turn("user", "hi")]})
    pairs = [{"prompt": "a", "completion": "b"}, {"prompt": "c"}, *[{"prompt": "e", "completion": "f"}] * 8]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(path))} record 2: has no 'completion' \(data.completion_field"
    ):
        build(section(type="instruction", path=str(path)))


def test_a_tokenizer_without_a_template_is_refused_naming_it_and_both_remedies(plain_tokenizer_dir):
    with pytest.raises(ValueError) as caught:
        build(section(tokenizer=str(plain_tokenizer_dir), chat_template=None))
    message = str(caught.value)
    assert str(plain_tokenizer_dir) in message and "has no chat template" in message
    assert "data.chat_template" in message and "tokenizer directory that ships one" in message
    assert len(build(section(tokenizer=str(plain_tokenizer_dir))).train) > 0  # the config's template serves


def test_bad_data_stops_prepare_before_any_process_group(tmp_path):
    """What `describe_run` (and `validate`) reads: the data error as one RunError, and the config's own
    problems as ConfigError naming the field."""
    hardware = detect_hardware(local_world_size=1)
    path = write_jsonl(tmp_path / "bad.jsonl", [sample_records(1)[0], {"messages": "hello"}])
    config = load_config(CONFIG, [f"data.path={path}"], world_size=1, hardware=hardware)
    with pytest.raises(
        RunError, match=rf"data error: {re.escape(str(path))} record 2: has 'messages' that is not a list"
    ):
        load_data(config)
    cases = {
        "data.tokenizer=char": 'data.tokenizer: "char" builds its vocabulary from plain text',
        "data.chat_template=null": 'data.chat_template: the "byte" tokenizer has no chat template',
        "data.chat_template=missing.jinja": "data.chat_template: 'missing.jinja' does not exist",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(CONFIG, [override], world_size=1, hardware=hardware)
    with pytest.raises(ConfigError, match=re.escape('data.packing: only data.type "chat" and "instruction" reads it')):
        load_config(CONFIG, ["data.type=text", "data.chat_template=null"], world_size=1, hardware=hardware)


def test_the_committed_chat_sample_is_what_the_module_writes():
    assert CHAT_SAMPLE.read_text(encoding="utf-8") == render_sample()
    records = [json.loads(line) for line in render_sample().splitlines()]
    roles = [{message["role"] for message in record["messages"]} for record in records]
    assert len(records) >= 200 and any("system" in r for r in roles) and any("tool" in r for r in roles)
    assert any(sum(message["role"] == "assistant" for message in r["messages"]) > 1 for r in records)


def test_no_engine_or_model_code_branches_on_a_data_kinds_name():
    names = "|".join(map(re.escape, KINDS))
    branches = re.compile(
        rf"""[!=]=\s*["']({names})["']|["']({names})["']\s*[!=]=|\bin\s*[(\[{{][^)\]}}]*["']({names})["']"""
        r"|isinstance\([^)]*(StreamedCorpus|PackedTokens|BlendedTokens|ImageDataset|Synthetic|Conversation)"
    )
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("engine", "models")
        for path in sorted((ROOT / package).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if branches.search(line)
    ]
    assert not found, "ask the data kind's registry entry (data/kinds/) instead:\n" + "\n".join(found)


def assert_same_samples(left, right) -> None:
    assert len(left) == len(right)
    for index in range(len(left)):
        for key, value in right[index].items():
            assert torch.equal(left[index][key], value), (index, key)
