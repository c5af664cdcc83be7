"""Tokenizers behind one small interface, so text loading never asks which kind it holds.

"char" and "byte" need no files and no download, which keeps the quick run offline; any
local Hugging Face tokenizer directory covers everything else. Saved, every kind loads with
`AutoTokenizer.from_pretrained` too: char and byte write a transformers fast tokenizer beside
their own file.
"""

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # transformers takes seconds to import; char and byte runs should not pay for it
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SIMPLE_TOKENIZER_FILE = "simple_tokenizer.json"
"""Written by the char and byte tokenizers; a distinct name so it never shadows HF files."""


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None:
        """The id that separates documents in a packed stream; None when there is none."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    @property
    def identity(self) -> str:
        """What decides the ids this tokenizer gives, for cache keys: its kind for char and byte (a
        char vocabulary follows from the corpus, which the key records), its whole definition for a
        Hugging Face tokenizer (normaliser and pre-tokenizer included, not only the vocabulary)."""
        ...

    def save(self, directory: Path) -> None: ...

    @property
    def fingerprint(self) -> str:
        """A digest of which token each id stands for. Checkpoints record it: a char vocabulary
        rebuilt from a corpus with other characters gives the same ids to other tokens."""
        ...


class CharTokenizer:
    """One id per character of the training text, in sorted order (nanoGPT's shakespeare_char)."""

    def __init__(self, vocab: Sequence[str]) -> None:
        if len(set(vocab)) != len(vocab) or any(len(char) != 1 for char in vocab):
            raise ValueError("a char tokenizer vocabulary must be distinct single characters")
        self._chars = list(vocab)
        self._ids = {char: i for i, char in enumerate(self._chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        if not text:
            raise ValueError("the char tokenizer builds its vocabulary from text, and none was given")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self._chars)

    @property
    def chars(self) -> list[str]:
        return list(self._chars)

    @property
    def identity(self) -> str:
        return "char"

    @property
    def eos_id(self) -> int | None:
        return None

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[char] for char in text]
        except KeyError as error:
            raise ValueError(
                f"character {error.args[0]!r} is not in this char tokenizer's vocabulary of "
                f"{self.vocab_size}; it was built from a different text"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._chars[int(i)] for i in ids)

    def save(self, directory: Path) -> None:
        _write_simple_config(directory, {"type": "char", "vocab": self._chars})
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        backend = Tokenizer(models.WordLevel({char: i for i, char in enumerate(self._chars)}, unk_token=None))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token a character
        backend.decoder = decoders.Fuse()
        _save_for_transformers(directory, backend)

    @property
    def fingerprint(self) -> str:
        return _digest("char", self._chars)


class ByteTokenizer:
    """UTF-8 bytes as ids: no vocabulary to build, and any text can be encoded."""

    @property
    def vocab_size(self) -> int:
        return 256

    @property
    def identity(self) -> str:
        return "byte"

    @property
    def eos_id(self) -> int | None:
        return None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A block boundary can cut a multi-byte character in two; show it rather than fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        _write_simple_config(directory, {"type": "byte"})
        self.transformers_form().save_pretrained(str(directory))

    def transformers_form(self) -> "PreTrainedTokenizerFast":
        """The same ids as a transformers fast tokenizer: what an export saves, so that
        `AutoTokenizer.from_pretrained` gives the ids the model was trained on, and what renders a chat
        template over byte-level chat data. No special tokens: every id is a byte."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        # GPT-2's printable stand-in for each byte, so that the vocabulary holds all 256 as text.
        stand_in = bytes_to_unicode()
        backend = Tokenizer(models.WordLevel({stand_in[byte]: byte for byte in range(256)}, unk_token=None))
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
            ]
        )
        backend.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=backend)

    @property
    def fingerprint(self) -> str:
        return "byte"


class HFTokenizer:
    """A tokenizer saved by `save_pretrained`, read from local files only."""

    def __init__(self, path: str | Path) -> None:
        # transformers takes seconds to import; char and byte runs should not pay for it.
        from transformers import AutoTokenizer

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as error:
            raise ValueError(f"could not load a Hugging Face tokenizer from {path}: {error}") from error

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too; `.vocab_size` does not, and the embedding must cover them.
        return len(self._tokenizer)

    @property
    def eos_id(self) -> int | None:
        return self._tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        # Whole documents are encoded before packing, so the model's max length does not apply.
        return self._tokenizer.encode(text, add_special_tokens=False, verbose=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts in one call: a fast tokenizer's Rust core encodes them on every core, and its
        `encode_batch_fast` skips the character offsets that tokenizing a corpus never reads."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self._tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        return [encoding.ids for encoding in backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    @property
    def identity(self) -> str:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is not None:
            definition = backend.to_str()
        else:
            definition = json.dumps(self._tokenizer.get_vocab(), sort_keys=True)
        return "hf:" + hashlib.sha256(definition.encode()).hexdigest()[:16]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def transformers(self) -> "PreTrainedTokenizerBase":
        """The transformers tokenizer itself: its chat template renders conversations."""
        return self._tokenizer

    def save(self, directory: Path) -> None:
        self._tokenizer.save_pretrained(str(directory))

    @property
    def fingerprint(self) -> str:
        vocabulary = self._tokenizer.get_vocab()  # added tokens included, as len() counts them
        return _digest("hf", sorted(vocabulary, key=vocabulary.__getitem__))


def _digest(kind: str, tokens: Sequence[str]) -> str:
    return f"{kind}:" + hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:16]


def load_tokenizer(spec: str, training_text: str | None) -> Tokenizer:
    """Build the tokenizer a config names: "char", "byte" or a local tokenizer directory."""
    if spec == "char":
        return CharTokenizer.from_text(training_text or "")
    if spec == "byte":
        return ByteTokenizer()
    if Path(spec).is_dir():
        return HFTokenizer(spec)
    raise ValueError(f"tokenizer {spec!r} is neither 'char', 'byte' nor an existing local tokenizer directory")


def load_saved_tokenizer(directory: Path) -> Tokenizer:
    """Read back what `Tokenizer.save` wrote, e.g. into an export, for generation."""
    directory = Path(directory)
    config_path = directory / SIMPLE_TOKENIZER_FILE
    if config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.get("type") == "char":
            return CharTokenizer(config["vocab"])
        if config.get("type") == "byte":
            return ByteTokenizer()
        raise ValueError(f"{config_path} names unknown tokenizer type {config.get('type')!r}")
    if directory.is_dir():
        return HFTokenizer(directory)
    raise ValueError(f"no saved tokenizer at {directory}: the directory does not exist")


def _save_for_transformers(directory: Path, backend: object) -> None:
    """The same tokenizer as a transformers fast tokenizer (tokenizer.json, tokenizer_config.json),
    so that `AutoTokenizer.from_pretrained` of an export gives the ids the model was trained on.
    No special tokens: the char and byte vocabularies have none, and every id is a character or byte."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(str(directory))


def _write_simple_config(directory: Path, config: dict) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SIMPLE_TOKENIZER_FILE).write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
