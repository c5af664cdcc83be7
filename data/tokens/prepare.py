"""A text corpus tokenized once into the cache, then memory-mapped by every launch that reads it.

`prepare_text` is what a launch, `validate`, `plan` and `python -m engine prepare-data` all call:
the first to need a corpus tokenizes it (data/tokens/encode.py) into a folder named by its cache
key (data/tokens/cache.py); everyone after maps that folder and reads only its meta.json.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from data.tokenizers import CharTokenizer, Tokenizer, load_tokenizer
from data.tokens.cache import corpus_key, prepared_corpus
from data.tokens.corpus import corpus_files, open_corpus
from data.tokens.encode import char_vocabulary, write_splits
from data.tokens.files import PreparedCorpus, publish, smallest_dtype, source_record


def prepare_text(
    paths: Sequence[Path],
    *,
    tokenizer: str,
    text_field: str,
    cache_dir: Path,
    timeout_s: float,
    announce: Callable[[str], None] = print,
) -> tuple[PreparedCorpus, Tokenizer]:
    """The corpus at `paths` tokenized by `tokenizer` ("char", "byte" or a Hugging Face directory),
    from the cache, built there first if no process has built it."""
    files = corpus_files(paths)
    known = None if tokenizer == "char" else load_tokenizer(tokenizer, training_text=None)
    identity = "char" if known is None else known.identity
    folder = Path(cache_dir) / corpus_key(source_record(files), identity, text_field)

    def build(staging: Path) -> None:
        names = ", ".join(map(str, paths))
        announce(f"data: tokenizing {names} with tokenizer {tokenizer!r} into {folder} (once; later runs reuse it)")
        staging.mkdir(parents=True)
        try:
            corpus = open_corpus(paths, text_field, staging / "scratch")
            chosen = known if known is not None else char_vocabulary(corpus)
            counts = write_splits(corpus, chosen, staging, announce)
            shutil.rmtree(staging / "scratch", ignore_errors=True)
            publish(staging, folder, _meta(chosen, tokenizer, text_field, files, counts))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    prepared = prepared_corpus(folder, build, timeout_s=timeout_s, announce=announce)
    return prepared, _tokenizer_of(prepared, known)


def _meta(tokenizer: Tokenizer, spec: str, text_field: str, files: list[Path], counts: dict) -> dict:
    record = {
        "spec": spec,
        "identity": tokenizer.identity,
        "fingerprint": tokenizer.fingerprint,
        "eos_id": tokenizer.eos_id,
    }
    if isinstance(tokenizer, CharTokenizer):
        record["vocab"] = tokenizer.chars
    return {
        "dtype": smallest_dtype(tokenizer.vocab_size).name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer": record,
        "text_field": text_field,
        "sources": source_record(files),
        "splits": counts,
    }


def _tokenizer_of(prepared: PreparedCorpus, known: Tokenizer | None) -> Tokenizer:
    record = prepared.meta["tokenizer"]
    if known is None:
        return CharTokenizer(record["vocab"])
    if known.fingerprint != record["fingerprint"]:
        raise ValueError(
            f"data.tokenizer: the token cache {prepared.folder} was written by another tokenizer "
            f"({record['fingerprint']}, this one is {known.fingerprint}); delete the folder to rebuild it"
        )
    return known
