"""Entry point for launchers: `deepspeed engine/main.py --deepspeed_config CONFIG [--set k=v ...]`,
`python engine/main.py ...` for one process, and `accelerate launch engine/main.py ...`."""

import atexit
import os
import sys
from pathlib import Path

# Launchers run this file as a script, which puts engine/ (not the project) first on sys.path;
# swap it so `import engine`, `models` and `data` resolve the same way with or without install.
_PROJECT = str(Path(__file__).resolve().parent.parent)
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = _PROJECT
elif _PROJECT not in sys.path:
    sys.path.insert(0, _PROJECT)

_finished: list[int] = []  # the exit status of a run that returned, once it has


def _end_without_teardown() -> None:
    """The last exit handler (registered before torch, DeepSpeed and transformers register theirs,
    so it runs after them): once a run has returned, every file is closed and every handler has
    run, and unloading those libraries module by module costs 1-2 s of CPU per rank (docs/design/failures.md)."""
    if _finished:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_finished[0])


if __name__ == "__main__":
    atexit.register(_end_without_teardown)
    from engine.failures.supervise import should_supervise, supervise

    if should_supervise():
        sys.exit(supervise(__file__, sys.argv[1:]))
    from engine.cli import train_main
    from engine.launch.signals import record_rank_exit

    _finished.append(train_main())
    # For launch.sh, whose launcher may report a rank's 75 (saved on preemption) as its own failure.
    record_rank_exit(_finished[0])
    sys.exit(_finished[0])
