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


def partition_built(model: Any, ds_config: dict[str, Any]) -> None:
    """Partition a model built whole (a family that does not build under `zero.Init`) as DeepSpeed would
    on `deepspeed.initialize`, in the dtype `ds_config` trains in.

    DeepSpeed converts such a model with `zero.Init(module=..., dtype=<its parameters' dtype>)`, and
    `Init._set_dtype` reads a given dtype as `(dtype or float16) if fp16 is supported else bfloat16`
    (partition_parameters.py, an operator-precedence slip): on an accelerator without fp16, such as
    DeepSpeed's CPU one, fp32 parameters swapped to NVMe are written and read back as bf16, and the
    first layer fails on mixed dtypes. Without a dtype, `Init` takes the config's, and DeepSpeed then
    finds every parameter already converted."""
    from deepspeed import zero

    zero.Init(module=model, config_dict_or_path=ds_config)
