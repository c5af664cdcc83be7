"""Conversations rendered with a chat template into token ids and a loss mask.

The template is the tokenizer's own (its `chat_template`, as `save_pretrained` wrote it) or
`data.chat_template`; it is rendered through transformers' `apply_chat_template`, as inference will
render it, and the text is then encoded without added special tokens (what `apply_chat_template`'s
own tokenization does).

Which tokens train. Most real templates (Llama 3's, Qwen2.5's) have no `{% generation %}` blocks,
so the assistant's tokens are found without them, for any template: for each assistant turn the
conversation before it is rendered with the generation prompt (`add_generation_prompt=True`: the
assistant's header) and the conversation through it without, and the tokens between the two ends are
that turn's. They are its content and whatever the template writes after it before the next turn:
ChatML's `<|im_end|>` and the newline after it, Llama 3's `<|eot_id|>`. The model so learns to end
its turn, as TRL's training templates mark it (`{% generation %}` around content, `<|im_end|>` and
newline). This holds only where each rendered prefix is a prefix of the whole conversation, in text
and in tokens: a template that rewrites earlier turns as later ones arrive, or a tokenizer that merges
tokens across the boundary, is refused naming the record, never silently mis-masked.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from data.chat.records import Conversation
from data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TEMPLATE_SUFFIX = ".jinja"
TRAIN_ON = ("assistant", "all")


@dataclass(frozen=True)
class ChatFormat:
    """How conversations become ids: the template, the transformers tokenizer that renders it (whose
    special tokens the template may name), the engine's tokenizer that encodes the text, and which
    tokens are targets (`train_on`)."""

    template: str
    renderer: PreTrainedTokenizerBase
    tokenizer: Tokenizer
    train_on: str

    @property
    def recipe(self) -> dict[str, Any]:
        """Everything besides the tokenizer's identity and the files that changes the ids or the mask:
        part of the token cache's key."""
        return {
            "template": hashlib.sha256(self.template.encode()).hexdigest(),
            "special_tokens": {key: str(value) for key, value in self.renderer.special_tokens_map.items()},
            "train_on": self.train_on,
        }

    def tokenize(self, batch: Sequence[tuple[Conversation, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each conversation's ids and loss mask (1 where the token is a target), from (conversation,
        where it is) pairs; a ValueError naming the record where it cannot be masked."""
        whole = self._render([conversation for conversation, _ in batch], [where for _, where in batch], False)
        if self.train_on == "all":
            return [(ids, np.ones(len(ids), dtype=np.uint8)) for ids in self._encode(whole)]
        turns = [
            (index, turn)
            for index, (conversation, where) in enumerate(batch)
            for turn in _assistant_turns(conversation, where)
        ]
        before = self._render(
            [batch[index][0][:turn] for index, turn in turns], [batch[index][1] for index, _ in turns], True
        )
        through = self._render(
            [batch[index][0][: turn + 1] for index, turn in turns], [batch[index][1] for index, _ in turns], False
        )
        ids = self._encode(whole + before + through)
        whole_ids, before_ids, through_ids = (
            ids[: len(batch)],
            ids[len(batch) : len(batch) + len(turns)],
            ids[len(batch) + len(turns) :],
        )
        masks = [np.zeros(len(tokens), dtype=np.uint8) for tokens in whole_ids]
        for position, (index, turn) in enumerate(turns):
            where = f"{batch[index][1]}: assistant turn (message {turn + 1})"
            if not whole[index].startswith(through[position]) or not through[position].startswith(before[position]):
                raise ValueError(
                    f"{where}: the chat template renders the conversation up to this turn differently from the "
                    "whole conversation (it rewrites earlier turns as later ones come), so the turn's tokens cannot "
                    'be told apart; use a template whose turns render alike whatever follows, or data.train_on "all"'
                )
            start, end = len(before_ids[position]), len(through_ids[position])
            full = whole_ids[index]
            if not (
                np.array_equal(full[:end], through_ids[position]) and np.array_equal(full[:start], before_ids[position])
            ):
                raise ValueError(
                    f"{where}: the tokenizer merges tokens across the boundary of this turn (its ids alone are not a "
                    "prefix of the whole conversation's), so the turn's tokens cannot be told apart; use a template "
                    'that ends each turn with a special token, or data.train_on "all"'
                )
            masks[index][start:end] = 1
        return list(zip(whole_ids, masks, strict=True))

    def _render(self, conversations: list[Conversation], places: list[str], prompt: bool) -> list[str]:
        """The conversations as text. On a template error each is rendered alone, to name the record."""
        if not conversations:
            return []
        try:
            return self._apply(conversations, prompt)
        except Exception:  # a Jinja template can raise anything (raise_exception()); found again by record
            for conversation, where in zip(conversations, places, strict=True):
                try:
                    self._apply([conversation], prompt)
                except Exception as error:
                    raise ValueError(
                        f"{where}: the chat template refuses it: {type(error).__name__}: {error}"
                    ) from None
            raise

    def _apply(self, conversations: list[Conversation], prompt: bool) -> list[str]:
        return self.renderer.apply_chat_template(
            conversations, chat_template=self.template, tokenize=False, add_generation_prompt=prompt
        )

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if isinstance(self.tokenizer, HFTokenizer):
            return [np.asarray(ids, dtype=np.int64) for ids in self.tokenizer.encode_batch(texts)]
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) for text in texts]


def _assistant_turns(conversation: Conversation, where: str) -> list[int]:
    turns = [index for index, message in enumerate(conversation) if message["role"] == "assistant"]
    if not turns:
        raise ValueError(
            f'{where}: has no assistant turn, so nothing in it trains under data.train_on "assistant"; give it '
            'one, leave it out, or train on every token with data.train_on "all"'
        )
    if turns[0] == 0:
        raise ValueError(
            f"{where}: opens with an assistant turn, whose header the template writes with no prompt before it to "
            "tell it from its content; open the conversation with a system or user turn"
        )
    return turns


def chat_format(tokenizer_spec: str, template: str | None, train_on: str) -> ChatFormat:
    """The format data.tokenizer, data.chat_template and data.train_on describe; one ValueError
    naming the tokenizer and both ways to supply a template where none is found."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"data.train_on: {train_on!r} is neither of {', '.join(TRAIN_ON)}")
    if tokenizer_spec == "char":
        raise ValueError(
            'data.tokenizer: "char" builds its vocabulary from plain text; conversations need a Hugging Face '
            'tokenizer directory (model.init_from\'s by default) or "byte" with data.chat_template'
        )
    tokenizer = load_tokenizer(tokenizer_spec, None)
    if isinstance(tokenizer, HFTokenizer):
        renderer = tokenizer.transformers
    elif isinstance(tokenizer, ByteTokenizer):
        renderer = tokenizer.transformers_form()
    else:
        raise ValueError(f"data.tokenizer: {tokenizer_spec!r} cannot render a chat template")
    return ChatFormat(_template(template, renderer, tokenizer_spec), renderer, tokenizer, train_on)


def _template(configured: str | None, renderer: PreTrainedTokenizerBase, tokenizer_spec: str) -> str:
    """data.chat_template (a .jinja file's text, or the Jinja string itself), else the tokenizer's own."""
    if configured is not None:
        if not configured.endswith(TEMPLATE_SUFFIX):
            return configured
        try:
            return Path(configured).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"data.chat_template: {configured} could not be read ({error.strerror})") from None
    if renderer.chat_template is None:
        where = (
            '"byte" has no chat template'
            if tokenizer_spec == "byte"
            else f"{tokenizer_spec} has no chat template (none in its tokenizer_config.json, no chat_template.jinja)"
        )
        raise ValueError(
            f"data.tokenizer: the tokenizer {where}; give the template in data.chat_template (a Jinja string, or "
            "the path of a .jinja file), or use a tokenizer directory that ships one"
        )
    return renderer.get_chat_template()
