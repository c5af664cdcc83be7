"""Per-rank log files: `<output_dir>/logs/rank<R>.log` holds everything rank R printed.

The redirection is at the file-descriptor level, so output from C++ (NCCL, gloo, DeepSpeed's op
builds) lands in the file too, not only Python's prints. Rank 0 also writes to the terminal, through
`tee`; the other ranks write only to their files, so eight ranks do not interleave on one screen.
A rank that fails still says so on the terminal (`announce`), pointing at its file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class RankOutput:
    def __init__(self, path: Path, terminal_fd: int) -> None:
        self.path = path
        self._terminal_fd = terminal_fd

    def announce(self, message: str) -> None:
        """One line on the terminal and in this rank's file, whichever rank this is."""
        line = (message.rstrip("\n") + "\n").encode()
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(self._terminal_fd, line)
        if self._terminal_fd != 2:
            os.write(2, line)


_PASSED_TO_RANKS = "INT TERM USR1 USR2"


def capture_rank_output(log_dir: Path, rank: int) -> RankOutput:
    """Send this process's stdout and stderr to its rank's file (and rank 0's to the terminal too)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    if rank == 0:
        for fd in (1, 2):
            # tee must outlive whatever signal the rank is sent (a Ctrl-C reaches the whole process group;
            # the deepspeed launcher passes SIGTERM to every process of the rank's tree) to pass on the
            # lines of the save that follows; it ends when the rank closes its end of the pipe.
            command = f"trap '' {_PASSED_TO_RANKS}; exec tee -a \"$0\""
            tee = subprocess.Popen(["sh", "-c", command, str(path)], stdin=subprocess.PIPE, stdout=fd)
            os.dup2(tee.stdin.fileno(), fd)
            tee.stdin.close()
        return RankOutput(path, 2)
    terminal = os.dup(2)
    os.set_inheritable(terminal, False)
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    return RankOutput(path, terminal)
