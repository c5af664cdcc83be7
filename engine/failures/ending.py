"""How a failed rank ends the job: named once, with the rank that failed first, and never by
waiting on peers that are gone."""

from __future__ import annotations

import os
import signal
import traceback
from typing import NoReturn

import torch.distributed as dist

from engine.failures.preemption import signal_received
from engine.failures.watchdog import Watchdog, beat_interval
from engine.observability.rank_logs import RankOutput
from engine.parallel.process_group import env_rank


def collective_timeout(silence_s: float) -> float:
    """Collectives wait a little longer than the watchdog, so a silent peer is named by the
    watchdog before a bare timeout error blames the rank that was waiting for it."""
    return silence_s + 3 * beat_interval(silence_s)


def end_after_failure(error: Exception, watchdog: Watchdog | None, output: RankOutput) -> NoReturn:
    """Log the traceback, tell every rank which rank failed first, and end this process.

    `os._exit`, not an exception: interpreter shutdown would wait on the process group and on
    DeepSpeed's threads, which is how a failed job turns into a hung one."""
    traceback.print_exc()
    summary = str(error).strip().splitlines()[0] if str(error).strip() else ""
    own = f"rank {env_rank()} failed: {type(error).__name__}: {summary}"
    if watchdog is not None:
        if _is_communication_error(error):
            _end_on_launcher_signal(
                f"rank {env_rank()}: a collective failed ({summary}); the launcher ended the job "
                "before the watchdog named the rank that failed first",
                output,
            )
            reason = watchdog.reported_failure(wait_s=watchdog.silence_s + 2 * watchdog.interval)
            if reason is not None:
                watchdog.end(reason)
        first = watchdog.report(own)
        if first != own:
            watchdog.end(first)
    output.announce(f"{own} (full log: {output.path})")
    os._exit(1)


def _end_on_launcher_signal(message: str, output: RankOutput) -> None:
    """While this rank waits for the watchdog to name a vanished peer, a launcher that saw the peer
    die sends SIGTERM (or SIGINT) to end the job: end at once, saying so, rather than wait out the
    launcher's grace period (30 s under the deepspeed launcher) until its SIGKILL. A signal caught
    before (as a request to save, engine/failures/preemption.py) ends it too."""

    def end(signum: int = 0, frame: object = None) -> None:
        output.announce(f"{message} (full log: {output.path})")
        os._exit(1)

    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, end)
    signal.set_wakeup_fd(-1)  # the preemption watcher stops hearing them: this rank is past saving
    if signal_received():  # it came before the collective failed here
        end()


def _is_communication_error(error: Exception) -> bool:
    """Errors a collective raises when a peer is gone: the peer, not this rank, is the culprit."""
    text = str(error)
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in text for mark in ("gloo", "NCCL", "Connection", "timed out"))
    )
