"""Signals to launch.sh reach the ranks, and the job's exit code says "saved, requeue me".

Launchers lose a preempted rank's exit code. DeepSpeed's launch.py, signalled itself, ends every
rank's process tree (SIGTERM, SIGKILL 30 s later) and exits 1, and SIGUSR1 kills it outright; when
a rank exits non-zero by itself it ends the others and exits with that rank's code. torchrun (and
`accelerate launch` for several processes) exits 1 whatever code a worker failed with. So launch.sh
keeps its launcher out of the way: it passes each signal to the ranks alone (`forward`), which save
and exit 75 (EX_TEMPFAIL), lets the launcher see them end, and reads the codes the ranks recorded
in ENGINE_RANK_EXITS (`record_rank_exit`) to choose its own (`job_exit_code`).

Stdlib only at import: a rank records its exit on its way out; psutil is imported by what needs it.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

from engine.launch.detect import SUPERVISED_ENV

# A directory, one per launch.sh, where each rank writes its exit code to `rank<RANK>`.
RANK_EXITS_ENV = "ENGINE_RANK_EXITS"
# sysexits' EX_TEMPFAIL: every rank saved and stopped early; start the job again (requeue).
EXIT_PREEMPTED = 75
_RECORD = re.compile(r"rank(\d+)")


def record_rank_exit(code: int) -> None:
    """Write this rank's exit code to `$ENGINE_RANK_EXITS/rank<RANK>` (RANK 0 where no launcher set
    one), for launch.sh to read once its launcher has ended; nothing where the variable is unset or
    names no directory (a launch without launch.sh, or a rank on another node).

    Call it as the last thing before exiting with a code the run chose (0, 75 after a save, 1 for an
    error), not from a signal's exit (128 + signal): a launcher ends a rank that lags its peers by a
    few milliseconds with SIGTERM, and that rank has nothing to report. The file appears whole or
    not at all (a temporary file, then os.replace), and an unwritable directory is ignored: an exit
    is never turned into a crash."""
    directory = os.environ.get(RANK_EXITS_ENV)
    if not directory or not os.path.isdir(directory):
        return
    rank = os.environ.get("RANK", "0")
    try:
        descriptor, temporary = tempfile.mkstemp(prefix=f".rank{rank}.", dir=directory)
        with os.fdopen(descriptor, "w") as file:
            file.write(f"{code}\n")
        os.replace(temporary, os.path.join(directory, f"rank{rank}"))
    except OSError:
        pass


def recorded_exits(directory: Path) -> dict[int, int]:
    """The exit code each rank recorded in `directory`, by rank."""
    exits = {}
    for path in directory.iterdir():
        match = _RECORD.fullmatch(path.name)
        if match is not None:
            exits[int(match.group(1))] = int(path.read_text())
    return exits


def job_exit_code(directory: Path, launcher_code: int) -> int:
    """75 where at least one rank recorded an exit and every one that did recorded 75, else the
    launcher's code.

    A rank that recorded nothing does not count against 75: ranks exit 75 only after the save every
    rank took part in is published and every rank has reached the run's last barrier, and the
    launcher kills the stragglers as soon as the first of them exits."""
    codes = set(recorded_exits(directory).values())
    return EXIT_PREEMPTED if codes == {EXIT_PREEMPTED} else launcher_code


def forward(launcher_pid: int, signum: int) -> int:
    """Send `signum` to the ranks started under `launcher_pid` and to nothing else, so that the
    launcher sees them exit with their own codes; returns how many processes were signalled.

    Before any rank has started, the signal goes to the launcher's whole tree, children first, as a
    terminal's Ctrl-C reaches it. Once the launcher has ended (`launcher_pid` 0, or gone), the ranks
    that outlived it are found by this process's ENGINE_RANK_EXITS, which they share."""
    import psutil

    try:
        launcher = psutil.Process(launcher_pid) if launcher_pid > 0 else None
        tree = [] if launcher is None else launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        launcher = None
    if launcher is None:
        return _send(stray_ranks(os.environ.get(RANK_EXITS_ENV)), signum)
    ranks = [process for process in tree if _is_rank(process)]
    return _send(ranks or [*tree, launcher], signum)


def stray_ranks(directory: str | None) -> list:
    """The ranks on this machine that record their exits in `directory`: one launch.sh's, found
    without their launcher, which may have died (none for None)."""
    import psutil

    if not directory:
        return []
    directory = os.path.normpath(directory)
    ranks = []
    for process in psutil.process_iter():
        try:
            recorded_in = process.environ().get(RANK_EXITS_ENV)
            if recorded_in and os.path.normpath(recorded_in) == directory and _is_rank(process):
                ranks.append(process)
        except psutil.Error:
            continue
    return ranks


def _send(processes: list, signum: int) -> int:
    import psutil

    sent = 0
    for process in processes:
        try:
            process.send_signal(signum)
            sent += 1
        except psutil.NoSuchProcess:
            continue
    return sent


def _is_rank(process) -> bool:
    """Whether `process` is a rank: the supervised child (engine/failures/supervise.py) of a process
    that is not supervised, or a launcher's only process, which runs engine/main.py without a RANK
    and is not supervised. What a rank starts in turn (data-loader workers, compiler jobs) inherits
    its environment and command line, and is left out by its parent being a rank."""
    import psutil

    try:
        parent = process.parent()
        if parent is None:
            return False
        if _supervised(process):
            return not _supervised(parent)
        return "RANK" not in process.environ() and _runs_main(process) and not _runs_main(parent)
    except psutil.Error:
        return False


def _supervised(process) -> bool:
    """ENGINE_SUPERVISED=1 in its environment, or where that cannot be read, engine/main.py started
    by engine/main.py."""
    import psutil

    try:
        return process.environ().get(SUPERVISED_ENV) == "1"
    except psutil.AccessDenied:
        parent = process.parent()
        return _runs_main(process) and parent is not None and _runs_main(parent)


def _runs_main(process) -> bool:
    return runs_engine_main(process.cmdline())


def runs_engine_main(command: list[str]) -> bool:
    """Whether `command` is a Python running engine/main.py as its script: not a launcher that
    names it among its arguments (`deepspeed ... engine/main.py`, `python -m deepspeed.launcher.launch`)."""
    words = command[1:]
    while words and words[0].startswith("-"):
        if words[0] in ("-c", "-m"):
            return False
        words = words[2:] if words[0] in ("-W", "-X") else words[1:]
    return bool(words) and Path(words[0]).parts[-2:] == ("engine", "main.py")


def wait_for_stray_ranks(directory: Path) -> None:
    """Return once no rank records its exit in `directory`: a launcher killed by a signal leaves
    ranks behind that may still be saving."""
    import psutil

    psutil.wait_procs(stray_ranks(str(directory)))


def named_signal(name: str) -> signal.Signals:
    """Signal `name`, with or without SIG ("SIGTERM", "TERM", "term"); ValueError for no such signal."""
    spelled = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    try:
        return signal.Signals[spelled]
    except KeyError:
        raise ValueError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None


def _signal_number(text: str) -> int:
    """A signal given as a number or a name, with or without SIG ("15", "TERM", "SIGTERM")."""
    if text.isdigit():
        return int(text)
    try:
        return named_signal(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a signal") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.launch.signals", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    forward_command = commands.add_parser("forward", help="send a signal to the ranks under a launcher")
    forward_command.add_argument("launcher_pid", type=int)
    forward_command.add_argument("signal", type=_signal_number)
    exit_command = commands.add_parser(
        "exit-code", help="wait for ranks that outlived their launcher, then exit with the job's code"
    )
    exit_command.add_argument("directory", type=Path, help="the ranks' ENGINE_RANK_EXITS")
    exit_command.add_argument("launcher_code", type=int)
    args = parser.parse_args(argv)
    if args.command == "forward":
        sent = forward(args.launcher_pid, args.signal)
        print(f"launch.sh: {signal.Signals(args.signal).name} passed to {sent} process(es)", file=sys.stderr)
        return 0
    wait_for_stray_ranks(args.directory)
    code = job_exit_code(args.directory, args.launcher_code)
    if code != args.launcher_code:
        print(
            f"launch.sh: the ranks saved and stopped: exit {code} (the launcher's was {args.launcher_code})",
            file=sys.stderr,
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
