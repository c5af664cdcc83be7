"""The token cache built by one process while others wait: two fresh processes started on a held
lock tokenize the corpus once between them. The rest of the cache is tested in-process in
tests/unit/test_token_cache.py."""

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from data.text import load_text_dataset
from tests.support.launch import ROOT
from tests.support.token_cache import SONNETS, cache_folders, write

OUTPUT = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}


def test_two_processes_building_the_same_cache_at_once_tokenize_it_once(tmp_path):
    """Both start while the corpus's lock is held (as on a node whose ranks start together), so both
    must wait; once it is free, one of them tokenizes and the other reads what it wrote."""
    corpus = write(tmp_path / "big.txt", SONNETS * 32)
    cache = tmp_path / "cache"
    load_text_dataset(corpus, seq_len=64, cache_dir=cache)
    (folder,) = cache_folders(cache)
    shutil.rmtree(folder)
    code = (
        "from data.text import load_text_dataset; "
        f"d = load_text_dataset({str(corpus)!r}, seq_len=64, cache_dir={str(cache)!r}); print('windows', len(d.train))"
    )
    with open(folder.with_name(folder.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        processes = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, **OUTPUT) for _ in range(2)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            time.sleep(0.5)
            if len([p for p in processes if p.poll() is None]) == 2 and _waiting(processes):
                break
        fcntl.flock(lock, fcntl.LOCK_UN)
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert all("data: waiting for" in output for output in outputs), outputs
    assert sum(output.count("data: tokenizing") for output in outputs) == 1, outputs
    assert len({line for output in outputs for line in output.splitlines() if line.startswith("windows")}) == 1
    assert len(cache_folders(cache)) == 1 and not list(cache.glob("*.partial-*"))


def _waiting(processes: list[subprocess.Popen]) -> bool:
    """Whether both processes have reached the lock: each then holds it open (seen in /proc)."""
    holders = 0
    for process in processes:
        try:
            fds = list(Path(f"/proc/{process.pid}/fd").iterdir())
            holders += any(os.readlink(fd).endswith(".lock") for fd in fds)
        except OSError:  # it exited, or closed a descriptor while being looked at
            return False
    return holders == 2
