"""A small parent for each launched rank that says which rank a signal killed.

When the kernel's out-of-memory killer or a segfault takes a rank, the process can print nothing,
and the deepspeed launcher only logs a return code against the wrong command line. Each rank is
therefore started as a child of this supervisor (stdlib only, started before torch is imported),
which waits for it and, if a signal the job did not send itself killed it, prints the rank, host,
pid and signal. Its exit status is the child's (128 + signal for a signal), so launchers still see
the failure. SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 come from the launcher, the scheduler or the user:
they are passed on, silently, and the supervisor waits for its rank, which saves and exits on the
ones trainer.signals names (engine/failures/preemption.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from engine.launch.detect import LAUNCHER_PID_ENV, SUPERVISED_ENV

_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def should_supervise() -> bool:
    """Ranks started by a distributed launcher, once (the child does not supervise again)."""
    return "RANK" in os.environ and SUPERVISED_ENV not in os.environ


def supervise(script: str, argv: list[str]) -> int:
    env = {**os.environ, SUPERVISED_ENV: "1", LAUNCHER_PID_ENV: str(os.getppid())}
    child = subprocess.Popen([sys.executable, "-u", script, *argv], env=env)

    def pass_on(signum: int, _frame: object) -> None:
        child.send_signal(signum)
        child.send_signal(signal.SIGCONT)  # a stopped (hung) rank must wake to die

    for signum in _PASSED_ON:
        signal.signal(signum, pass_on)
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
