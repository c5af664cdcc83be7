"""Ends every rank, naming the culprit, when one rank dies or stops answering.

A collective with a dead peer can wait for its full timeout (NCCL, or any group DeepSpeed made
with `new_group`, whose timeout is not the world group's) and its error rarely says which rank
is gone. So each rank runs a thread that beats a counter in the job's rendezvous store and
watches its ring neighbour's counter. A neighbour silent for `silence_s` is reported, once, under
one key; the first report wins and every rank's thread ends its process with that reason. A rank
whose own code fails reports itself the same way. The store is a second client of the one the
launcher set up (MASTER_ADDR:MASTER_PORT), so the watchdog needs no extra port and works under
the deepspeed launcher, torchrun and `accelerate launch` alike.

Cost: three small store requests per rank per beat (every silence_s / 10, at most 5 s).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

# Exit status of a rank that ends because another rank failed (its own failures exit 1).
PEER_FAILED_EXIT = 3


def beat_interval(silence_s: float) -> float:
    return min(5.0, max(0.5, silence_s / 10))


class Watchdog:
    def __init__(self, rank: int, world_size: int, silence_s: float, announce: Callable[[str], None]) -> None:
        self.rank, self.world_size, self.silence_s = rank, world_size, silence_s
        self.interval = beat_interval(silence_s)
        self._announce = announce
        self._address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        client = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=silence_s),
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(f"engine/watchdog/{attempt}/", client)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._store.add(f"beat/{self.rank}", 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating; the neighbour sees `done` and stops watching this rank."""
        self._stopping.set()
        self._thread.join()
        self._store.set(f"done/{self.rank}", "1")

    def report(self, reason: str) -> str:
        """Record `reason` as the job's failure unless another rank was first; returns the winner
        (`reason` itself when the store is gone, as it is when rank 0 failed)."""
        try:
            return self._store.compare_set("failed", "", reason).decode()
        except dist.DistError:
            return reason

    def reported_failure(self, wait_s: float) -> str | None:
        """The failure some rank reported, waiting up to `wait_s` for one to appear.

        A collective that fails because a peer vanished raises on the survivors before the
        watchdog has seen the peer fall silent; waiting lets the error name the peer, not them."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if self._store.check(["failed"]):
                    return self._store.get("failed").decode()
            except dist.DistError as error:
                return self._store_lost(error)
            time.sleep(self.interval / 2)
        return None

    def end(self, reason: str) -> None:
        self._announce(f"rank {self.rank}: ending: {reason}")
        os._exit(PEER_FAILED_EXIT)

    def _watch(self) -> None:
        peer = (self.rank + 1) % self.world_size
        last_count, last_change = -1, time.monotonic()
        while not self._stopping.wait(self.interval):
            try:
                self._store.add(f"beat/{self.rank}", 1)
                if self._store.check(["failed"]):
                    self.end(self._store.get("failed").decode())
                if self._store.check([f"done/{peer}"]):
                    continue
                count, now = self._store.add(f"beat/{peer}", 0), time.monotonic()
                if count != last_count:
                    last_count, last_change = count, now
                elif now - last_change > self.silence_s:
                    self.end(self.report(f"rank {peer} stopped answering (no heartbeat for {now - last_change:.0f} s)"))
            except dist.DistError as error:
                if self._stopping.is_set():
                    return
                self.end(self._store_lost(error))

    def _store_lost(self, error: Exception) -> str:
        return (
            f"lost the job's rendezvous store at {self._address} ({type(error).__name__}): the process hosting "
            "it (rank 0 under the deepspeed launcher) ended: interrupted (Ctrl-C), killed or crashed, or its node "
            "was lost"
        )
