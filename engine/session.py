"""One rank's session: the checks of engine/describe.py first, then the process group, the
watchdog and the per-rank log around the trainer, and a teardown that every rank reaches. A
failure once the group is up ends the job through engine/failures/ending.py, never a hang."""

from __future__ import annotations

import sys

from engine.backends.base import StepHooks
from engine.config import ConfigError
from engine.describe import describe_run
from engine.failures.ending import collective_timeout, end_after_failure
from engine.failures.faults import FaultHooks
from engine.failures.watchdog import Watchdog
from engine.observability.rank_logs import capture_rank_output
from engine.parallel.process_group import (
    barrier,
    destroy_process_group,
    env_rank,
    env_world_size,
    init_process_group,
)
from engine.preflight import RunError
from engine.trainer import Trainer


def run(config_path: str, overrides: list[str], hooks: StepHooks | None = None) -> int:
    """One rank's whole run; the exit code. `hooks` step into the run (bench/paired.py pairs its
    baseline there); by default, the fault `ENGINE_FAULT` asks for, if any."""
    try:
        description = describe_run(config_path, overrides)
    except (ConfigError, RunError) as error:
        # Every rank prints: the launcher ends the others as soon as the first one exits, so a
        # message left to rank 0 alone is lost whenever another rank gets there first.
        print(error, file=sys.stderr)
        return 2

    trainer = description.config.trainer
    output = capture_rank_output(trainer.output_path / "logs", env_rank())
    device = init_process_group(description.hardware.device_type, timeout_s=collective_timeout(trainer.comm_timeout_s))
    watchdog = None
    if env_world_size() > 1:
        watchdog = Watchdog(env_rank(), env_world_size(), trainer.comm_timeout_s, output.announce).start()
    try:
        code = Trainer(description, device, hooks or FaultHooks(description.fault, env_rank())).run()
        # Rank 0 is still drawing plots: the watchdog keeps watching until every rank is here.
        barrier()
    except Exception as error:
        end_after_failure(error, watchdog, output)
    if watchdog is not None:
        watchdog.stop()
    barrier()  # rank 0 hosts the store: it leaves only once every watchdog has written `done` there
    destroy_process_group()
    return code
