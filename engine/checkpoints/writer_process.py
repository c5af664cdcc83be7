"""The process that writes a rank's checkpoint files under `trainer.async_save`.

A process, not a thread: a thread's torch.save holds the GIL for much of its work, and a training
thread that waits for the GIL at every operation ran at 0.47 of its speed beside one (at 0.94
beside this process; docs/design/checkpoints.md). It runs at idle CPU priority, so where the host's cores are
busy training it writes in their gaps; it ignores the signals that stop a run (its rank decides)
and dies with its rank. This module imports the standard library only, so that what a spawned
process imports first is nothing it need not.
"""

from __future__ import annotations

import ctypes
import os
import signal
from multiprocessing.queues import Queue

_PR_SET_PDEATHSIG = 1


def serve(jobs: Queue, results: Queue, parent: int) -> None:
    """The writer's loop: each job is (skeleton, buffer, path, zipfile), a state `pack`ed
    (engine/checkpoints/packing.py); the small tensors are cloned apart, so every tensor is saved in
    storage of its own, as DeepSpeed's `clone_tensors_for_torch_save` makes them: the file is the
    one a synchronous save writes. Each result is (path, None) or (path, the error); the first,
    (None, None), says the writer is ready."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the rank died before the line above
        os._exit(1)
    # A scheduler's SIGTERM reaches every process of the job, and the deepspeed launcher's reaches
    # every process under a rank: the rank decides, and the save it makes on a signal needs this one.
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)
    import torch

    from engine.checkpoints.packing import rebuild

    torch.set_num_threads(1)
    # Imported at normal priority (seconds of CPU, while the rank initialises), written at idle.
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    results.put((None, None))  # ready
    while (job := jobs.get()) is not None:
        skeleton, buffer, path, zipfile = job
        try:
            torch.save(rebuild(skeleton, buffer), path, _use_new_zipfile_serialization=zipfile)
            results.put((path, None))
        except Exception as error:  # reported to the rank, which ends the run
            results.put((path, f"{type(error).__name__}: {error}"))
        del job, skeleton, buffer
