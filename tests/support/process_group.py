"""A process group of one in the test process, as engine.session starts it on every backend: for code
that asks deepspeed.comm or torch.distributed for the rank (DeepSpeed's MonitorMaster, torch
distributed checkpoint). It ends through DeepSpeed's own teardown where DeepSpeed joined it: that drops
the groups DeepSpeed cached (its world and data-parallel groups), which the next module's group of
one would otherwise find stale ("Group ... is not registered")."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from engine.parallel.process_group import destroy_process_group, init_process_group
from tests.support.launch import free_port


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            patch.setenv(name, value)
        patch.setenv("MASTER_PORT", str(free_port()))
        init_process_group("cpu")
        try:
            yield
        finally:
            deepspeed_comm = sys.modules.get("deepspeed.comm")
            if deepspeed_comm is not None and deepspeed_comm.is_initialized():
                deepspeed_comm.destroy_process_group()
            destroy_process_group()
