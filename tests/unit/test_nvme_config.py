"""ZeRO-Infinity's NVMe offload in a config: what reaches DeepSpeed, as DeepSpeed's own readers read it,
and what is refused before launch (the refusals of stages 1-2 and the accelerate backend are rows of
tests/unit/test_deepspeed_keys.py). The launched runs are tests/launched/test_nvme_offload.py."""

from __future__ import annotations

from pathlib import Path

from deepspeed.runtime.swap_tensor.aio_config import get_aio_config
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from tests.unit.test_deepspeed_spellings import load, tiny_gpt

ZERO3_NVME = {
    "stage": 3,
    "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4, "buffer_size": 2_000_000},
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4},
}


def test_nvme_offload_and_its_aio_section_reach_deepspeed_as_written(tmp_path: Path):
    aio = {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2, "single_submit": True}
    config = load(tmp_path, tiny_gpt(zero_optimization=ZERO3_NVME, aio=aio), world_size=2)
    document = config.deepspeed_config()
    zero = DeepSpeedZeroConfig(**document["zero_optimization"])
    assert zero.offload_param.device == "nvme" and str(zero.offload_param.nvme_path) == "/local_nvme"
    assert zero.offload_param.buffer_size == 2_000_000 and zero.offload_optimizer.buffer_count == 4
    read = get_aio_config(document)
    assert (read["block_size"], read["queue_depth"], read["intra_op_parallelism"], read["single_submit"]) == (
        262144,
        16,
        2,
        True,
    )


def test_aio_thread_count_is_read_as_intra_op_parallelism_with_a_notice(tmp_path: Path):
    """DeepSpeed 0.19.8 no longer reads `thread_count` (runtime/swap_tensor/aio_config.py): a document's
    `"thread_count": 2` would run one thread there, saying nothing."""
    config = load(tmp_path, tiny_gpt(zero_optimization=ZERO3_NVME, aio={"thread_count": 2}), world_size=2)
    assert config.notices == ("aio.thread_count is deprecated in DeepSpeed; read as aio.intra_op_parallelism",)
    assert get_aio_config(config.deepspeed_config())["intra_op_parallelism"] == 2
