"""A small parent for each launched rank that says which rank a signal killed, and stops the rank
when the command that started the job is gone.

When the kernel's out-of-memory killer or a segfault takes a rank, the process can print nothing,
and the deepspeed launcher only logs a return code against the wrong command line. Each rank is
therefore started as a child of this supervisor (stdlib only, started before torch is imported),
which waits for it and, if a signal the job did not send itself killed it, prints the rank, host,
pid and signal. Its exit status is the child's (128 + signal for a signal), so launchers still see
the failure. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 come from the launcher, the scheduler or the user:
they are passed on, silently, and the supervisor waits for its rank, which saves and exits on the
ones trainer.signals names (engine/failures/preemption.py).

The `deepspeed` command exits at once on a SIGTERM (what a scheduler or a container runtime sends
the command the user typed) without passing it on: its per-node launcher and the ranks would train
on, orphaned, and save nothing. So the supervisor also watches the chain from itself up to that
command (`job_top`) and, once a link breaks, sends its rank the SIGTERM the command did not pass on.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.launch.detect import LAUNCHER_PID_ENV, SUPERVISED_ENV, TOP_PID_ENV

_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# How often the chain up to the job's top process is checked: a read of /proc on the supervisor's
# thread, so a step pays nothing, and well inside the 2 s in which the ranks count copies of one
# signal once (a SIGTERM to every process of the job also ends the `deepspeed` command).
_CHAIN_CHECK_S = 1.0


def should_supervise() -> bool:
    """Ranks started by a distributed launcher, once (the child does not supervise again)."""
    return "RANK" in os.environ and SUPERVISED_ENV not in os.environ


def parent_pid(pid: int) -> int | None:
    """The parent of `pid`, from /proc (None: gone, or no /proc). A process that has exited but is
    not yet reaped still names its parent; its children are re-parented the moment it exits."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name in parentheses may hold spaces


def job_top(launcher: int) -> int:
    """The process that stands for the job, the command the user typed: above DeepSpeed's per-node
    launcher, whatever started it (the `deepspeed` runner, or the ssh session of the pdsh route);
    otherwise the launcher itself (torchrun, `accelerate launch`, torch.distributed.launch), which
    passes a SIGTERM on to its ranks and waits for them."""
    try:
        command = Path(f"/proc/{launcher}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return launcher
    if b"deepspeed.launcher.launch" not in command:
        return launcher
    parent = parent_pid(launcher)
    return launcher if parent is None else parent


def job_intact(launcher: int, top: int) -> bool:
    """Whether this supervisor is still the launcher's child and the launcher still `top`'s. Parent
    links, not pids: a pid is reused once its process is reaped, a parent link never comes back."""
    return os.getppid() == launcher and (top == launcher or parent_pid(launcher) == top)


def supervise(script: str, argv: list[str]) -> int:
    launcher = os.getppid()
    top = job_top(launcher)
    env = {**os.environ, SUPERVISED_ENV: "1", LAUNCHER_PID_ENV: str(launcher), TOP_PID_ENV: str(top)}
    child = subprocess.Popen([sys.executable, "-u", script, *argv], env=env)
    passed_on = threading.Event()

    def pass_on(signum: int, _frame: object) -> None:
        passed_on.set()
        child.send_signal(signum)
        child.send_signal(signal.SIGCONT)  # a stopped (hung) rank must wake to die

    for signum in _PASSED_ON:
        signal.signal(signum, pass_on)
    watcher = threading.Thread(
        target=_stop_when_orphaned, args=(child, launcher, top, passed_on), name="job-top", daemon=True
    )
    watcher.start()
    code = child.wait()
    if code >= 0:
        return code
    signum = -code
    if signum not in _PASSED_ON:
        name = signal.Signals(signum).name
        hint = " (the kernel's out-of-memory killer, or a kill -9)" if signum == signal.SIGKILL else ""
        print(
            f"rank {os.environ['RANK']} (local rank {os.environ.get('LOCAL_RANK', '?')} on {socket.gethostname()}, "
            f"pid {child.pid}) was killed by {name}{hint}",
            file=sys.stderr,
            flush=True,
        )
    return 128 + signum


def _stop_when_orphaned(child: subprocess.Popen, launcher: int, top: int, passed_on: threading.Event) -> None:
    """Once the chain up to `top` breaks, SIGTERM to the rank, as if `top` had passed its signal on:
    the rank saves and exits 75 (or, where trainer.signals leaves SIGTERM out, dies of it). Not after
    a signal this supervisor passed on: the rank already has it, and a second would end it unsaved."""
    while job_intact(launcher, top):
        time.sleep(_CHAIN_CHECK_S)
    if passed_on.is_set():
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(
            f"the command that started this job (pid {top}) has ended without stopping its ranks: "
            f"SIGTERM to the ranks on {socket.gethostname()}, which save and stop",
            file=sys.stderr,
            flush=True,
        )
    child.send_signal(signal.SIGTERM)
    child.send_signal(signal.SIGCONT)
