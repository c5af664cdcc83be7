"""Entry point for launchers: `deepspeed engine/main.py --deepspeed_config CONFIG [--set k=v ...]`,
`python engine/main.py ...` for one process, and later `accelerate launch engine/main.py ...`."""

import sys
from pathlib import Path

# Launchers run this file as a script, which puts engine/ (not the project) first on sys.path;
# swap it so `import engine`, `models` and `data` resolve the same way with or without install.
_PROJECT = str(Path(__file__).resolve().parent.parent)
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = _PROJECT
elif _PROJECT not in sys.path:
    sys.path.insert(0, _PROJECT)

if __name__ == "__main__":
    from engine.failures.supervise import should_supervise, supervise

    if should_supervise():
        sys.exit(supervise(__file__, sys.argv[1:]))
    from engine.cli import train_main

    sys.exit(train_main())
