"""Where prepared corpora live, what names them, and how one process per node builds each.

A corpus is prepared once and reused by every later launch, `validate` and `plan`. Its folder is
named by a digest of everything that changes the tokens: each source file's path, size and
modification time, the tokenizer (its full definition, not its name), the text field and the
format version. Editing a file, touching it, or pointing at another tokenizer therefore prepares
anew; the old folder stays until removed by hand.

Every rank of a job reaches this before any process group exists. The first to take the
folder's lock (an `flock`: released by the kernel if its holder dies, so a crashed build never
leaves a stale lock) builds; the others wait on the lock, then find the folder whole and read it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from data.tokens.files import VERSION, PreparedCorpus, damage, open_prepared, read_meta

CACHE_ENV = "DSENGINE_DATA_CACHE"
_POLL_S = 0.2


def default_cache_dir() -> Path:
    """$DSENGINE_DATA_CACHE, else ~/.cache/dsengine/tokens (under $XDG_CACHE_HOME where it is set)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dsengine" / "tokens"


def corpus_key(
    sources: list[dict[str, Any]], tokenizer_identity: str, text_field: str, recipe: dict[str, Any] | None = None
) -> str:
    """The folder name of one corpus prepared with one tokenizer; `recipe`, for conversations, holds
    what else changes their ids and loss mask (the chat template, which tokens train)."""
    record = {"version": VERSION, "sources": sources, "tokenizer": tokenizer_identity, "text_field": text_field}
    if recipe is not None:
        record["recipe"] = recipe
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]


class CacheWaitTimeout(TimeoutError):
    pass


def prepared_corpus(
    folder: Path, build: Callable[[Path], None], *, timeout_s: float, announce: Callable[[str], None] = print
) -> PreparedCorpus:
    """The prepared corpus at `folder`, built by `build(staging_folder)` if no process has built it.

    `build` writes a staging folder and publishes it to `folder` (files.publish). A damaged folder
    (a copy cut short, a file truncated after the fact) is rebuilt, never read."""
    if damage(folder) is None:  # checked once: open_prepared would check the same sizes again
        return PreparedCorpus(folder, read_meta(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(folder.with_name(folder.name + ".lock"), timeout_s, announce):
        problem = damage(folder)
        if problem is None:  # another process built it while this one waited
            return PreparedCorpus(folder, read_meta(folder))
        if folder.exists():
            announce(f"data: rebuilding the damaged token cache {folder} ({problem})")
        staging = folder.with_name(f"{folder.name}.partial-{socket.gethostname()}-{os.getpid()}")
        build(staging)
    return open_prepared(folder)


@contextmanager
def _exclusive(lock_path: Path, timeout_s: float, announce: Callable[[str], None]) -> Iterator[None]:
    with open(lock_path, "a+") as lock:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "another process"
                if not waited:
                    announce(f"data: waiting for {holder} to finish tokenizing into {lock_path.with_suffix('')}")
                    waited = True
                if time.monotonic() > deadline:
                    raise CacheWaitTimeout(
                        f"data.cache_timeout_s: waited {timeout_s:g} s for {holder} to finish tokenizing into "
                        f"{lock_path.with_suffix('')}; raise data.cache_timeout_s, or prepare the corpus before "
                        "launching (python -m engine prepare-data CONFIG)"
                    ) from None
                time.sleep(_POLL_S)
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        lock.flush()
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
