"""Under ZeRO-3, a model is built already partitioned: no rank ever holds all of its weights.

transformers builds its models inside `deepspeed.zero.Init` while an `HfDeepSpeedConfig` of a ZeRO-3
config is alive (its documented route for DeepSpeed without its Trainer): each module's weights are
partitioned as soon as the module exists, and rank 0's draws are scattered module by module. Without
it every rank would first build the whole model in host memory, which for large models on a node of
eight is eight full copies before DeepSpeed partitions anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def partitioned_build(ds_config: dict[str, Any]) -> Iterator[None]:
    """Models built inside come out partitioned as `ds_config` (a ZeRO-3 config) partitions them.

    The integration is switched off again on leaving: it must not outlive the build, or loading the
    export on rank 0 alone would enter `zero.Init`, a collective, and wait for the other ranks forever.
    """
    from transformers.integrations import HfDeepSpeedConfig, unset_hf_deepspeed_config

    integration = HfDeepSpeedConfig(ds_config)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del integration
