"""data.type "chat": conversations (records of `messages`), rendered with the tokenizer's chat
template or data.chat_template, tokenized once into the token cache with a loss mask, and served one
per sample or packed (data/chat/). data.path null reads the project's own chat sample."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from data.bundle import DataBundle
from data.chat.prepare import prepare_conversations
from data.chat.prompt import reply_prompt
from data.chat.records import ToConversation, chat_conversation
from data.chat.render import TEMPLATE_SUFFIX, TRAIN_ON, ChatFormat, chat_format
from data.chat.samples import (
    EXCESS_LENGTH,
    Conversations,
    ConversationSamples,
    PackedConversations,
    select,
)
from data.corpus import CHAT_SAMPLE
from data.kinds.common import BuildRequest, Footprint
from data.kinds.text import cache_dir
from data.tokens.cache import default_cache_dir
from data.tokens.files import PreparedCorpus

GIVES = ("tokens",)
PATH_NEEDED = None  # null: the project's chat sample
READS_TOKENIZER = True
MASKS_LABELS = True
SCHEMA = {
    "chat_template": {
        "type": ["string", "null"],
        "description": "chat and instruction: the Jinja chat template conversations are rendered with, as the "
        "template itself or the path of a .jinja file. null: the tokenizer's own (data.tokenizer's directory, "
        "model.init_from's by default); a tokenizer without one is refused.",
        "default": None,
    },
    "train_on": {
        "enum": list(TRAIN_ON),
        "description": 'chat and instruction: which tokens are targets. "assistant": each assistant turn\'s '
        "content and the end-of-turn tokens the template writes after it (ChatML's <|im_end|> and newline, Llama "
        "3's <|eot_id|>), found by rendering the conversation's prefixes, so any template works; \"all\": every "
        "token.",
        "default": "assistant",
    },
    "packing": {
        "type": "boolean",
        "description": "chat and instruction: fill each sample of data.seq_len tokens with whole conversations, "
        "greedily in file order, positions restarting at each one so that attention never crosses them (the "
        "tail padded and never a target). false: one conversation per sample, a micro-batch padded on the right "
        "to its longest, rounded up to a multiple of 8.",
        "default": False,
    },
    "excess_length_strategy": {
        "enum": list(EXCESS_LENGTH),
        "description": "chat and instruction: a conversation longer than data.seq_len tokens is refused, naming "
        'its file and record ("raise"), or keeps its first data.seq_len tokens ("truncate"; one left with no '
        "target is skipped). axolotl's name.",
        "default": "raise",
    },
}


def path_exists(key: str, path: str, data: Mapping[str, Any]) -> bool:
    return os.path.exists(path)


def config_issues(data: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """What a chat or instruction config can get wrong that the schema cannot say."""
    if data["tokenizer"] == "char":
        yield (
            "data.tokenizer",
            '"char" builds its vocabulary from plain text; conversations need a Hugging Face tokenizer directory '
            '(model.init_from\'s is the default) or "byte" with data.chat_template',
        )
    template = data["chat_template"]
    if template is None and data["tokenizer"] == "byte":
        yield (
            "data.chat_template",
            'the "byte" tokenizer has no chat template: give one here (a Jinja string, or the path of a .jinja '
            "file), or set data.tokenizer to a tokenizer directory that ships one",
        )
    if template is not None and template.endswith(TEMPLATE_SUFFIX) and not os.path.isfile(template):
        yield "data.chat_template", f"{template!r} does not exist"


def build(data: Mapping[str, Any], request: BuildRequest) -> DataBundle:
    return build_conversations(data, request, "chat", chat_conversation)


def build_conversations(
    data: Mapping[str, Any], request: BuildRequest, kind: str, to_conversation: ToConversation
) -> DataBundle:
    """Training and validation samples of conversations: held out by data.validation_path, by the
    source's own validation split, or as the last data.validation_fraction of conversations."""
    chat, train_source, held_out = prepare(data, kind, to_conversation)
    train = Conversations.of(train_source, "train")
    if held_out is not None:
        validation, train_order, validation_order = Conversations.of(held_out, "train"), None, None
    elif "validation" in train_source.splits:
        validation, train_order, validation_order = Conversations.of(train_source, "validation"), None, None
    else:
        cut = int(len(train) * (1 - data["validation_fraction"]))
        validation, train_order, validation_order = train, np.arange(cut), np.arange(cut, len(train))
    seq_len, strategy = request.seq_len, data["excess_length_strategy"]
    samples = PackedConversations if data["packing"] else ConversationSamples
    datasets = [
        samples(
            part,
            select(part, np.arange(len(part)) if order is None else order, seq_len=seq_len, excess_length=strategy),
            seq_len,
        )
        for part, order in ((train, train_order), (validation, validation_order))
    ]
    if not len(datasets[0]) or not len(datasets[1]):
        raise ValueError(
            f"{train_source.folder}: the conversations make {len(datasets[0])} training and {len(datasets[1])} "
            "validation samples, and each set needs at least one; give more conversations, or another "
            "data.validation_fraction or data.validation_path"
        )
    tokenizer = chat.tokenizer
    prompt = reply_prompt(datasets[1].conversations, int(datasets[1].selection.indices[0]))
    return DataBundle(
        kind, *datasets, tokenizer, tokenizer.vocab_size, None, chat_template=chat.template, sample_prompt=prompt
    )


def prepare(
    data: Mapping[str, Any], kind: str, to_conversation: ToConversation
) -> tuple[ChatFormat, PreparedCorpus, PreparedCorpus | None]:
    """The chat format, and in the token cache the training records and the held-out ones
    (data.validation_path)."""
    chat = chat_format(data["tokenizer"], data["chat_template"], data["train_on"])
    cache = Path(cache_dir(data) or default_cache_dir())
    options = {
        "kind": kind,
        "to_conversation": to_conversation,
        "chat": chat,
        "cache_dir": cache,
        "timeout_s": data.get("cache_timeout_s", 3600),
    }
    train = prepare_conversations(paths(data["path"], "data.path"), **options)
    held_out = data.get("validation_path")
    if held_out is None:
        return chat, train, None
    return chat, train, prepare_conversations(paths(held_out, "data.validation_path"), **options)


def paths(path: str | list[str] | None, field: str) -> list[Path]:
    """A path setting as a list of paths; data.path null is the project's chat sample."""
    if path is None:
        return [CHAT_SAMPLE]
    chosen = [Path(path)] if isinstance(path, str | Path) else [Path(p) for p in path]
    if not chosen:
        raise ValueError(f"{field} is an empty list; give at least one file")
    return chosen


def footprint(bundle: DataBundle) -> Footprint:
    """The ids and masks are mapped (once, where training and validation share a split); the
    conversation offsets, the order of each set and its packed windows are each rank's own. A
    worker's sample is at most data.seq_len tokens of ids, labels and positions."""
    mapped = loaded = 0
    seen: set[int] = set()
    for dataset in (bundle.train, bundle.validation):
        conversations = dataset.conversations
        if id(conversations) not in seen:
            seen.add(id(conversations))
            mapped += conversations.tokens.nbytes + conversations.mask.nbytes
            loaded += conversations.bounds.nbytes
        loaded += dataset.selection.indices.nbytes + dataset.selection.lengths.nbytes
        loaded += getattr(dataset, "windows", np.empty(0, dtype=np.int64)).nbytes
    return Footprint(3 * 8 * bundle.train.seq_len, loaded, mapped)


def prepare_ahead(data: Mapping[str, Any]) -> str:
    return describe(*prepare(data, "chat", chat_conversation))


def describe(chat: ChatFormat, train: PreparedCorpus, held_out: PreparedCorpus | None) -> str:
    parts = []
    for prepared in (train, held_out):
        if prepared is None:
            continue
        for split in prepared.splits:
            counts = prepared.meta["splits"][split]
            parts.append(
                f"{prepared.folder} {split}: {counts['documents']:,} conversations, {counts['tokens']:,} tokens, "
                f"{counts['targets']:,} targets"
            )
    return "; ".join(parts) + f" ({train.dtype.name} ids, a uint8 loss mask); vocabulary {train.meta['vocab_size']}"
