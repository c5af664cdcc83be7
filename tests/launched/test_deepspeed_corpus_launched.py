"""Four real DeepSpeed configs from the corpus (tests/data/deepspeed_configs), their DeepSpeed keys
as their projects wrote them and the tiny GPT's model, data and trainer added, trained on 2 ranks
under the deepspeed launcher and compared number for number with one process.

They stand in for the parity matrix's offloaded GPT rows (test_parity.py): the same ZeRO-2 and
ZeRO-3 offload paths, reached through HF's "auto", the deprecated spellings and torch_adam under
offload, as users bring them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.compare import CLIPPED_WEIGHT_TOLERANCE, LOSS_TOLERANCE, assert_weights_match, max_loss_difference
from tests.support.launch import ROOT, launch
from tests.support.reference import reference_run

CORPUS = ROOT / "tests" / "data" / "deepspeed_configs"
TRAINED = [
    # ZeRO-2 with optimizer offload; every HF "auto": batch, lr, betas, eps, decay, warm-up, clipping.
    "transformers__tests.deepspeed.ds_config_zero2.json",
    # ZeRO-3 offloading parameters and optimizer; `bfloat16` and stage3_gather_fp16_weights_on_model_save.
    "transformers__tests.deepspeed.ds_config_zero3_bf16.json",
    # ZeRO-3 offload stepped by torch's AdamW (torch_adam), as accelerate's own tests run it.
    "accelerate__tests.deepspeed.ds_config_zero3.json",
    # DeepSpeedExamples' pipeline example: 256 samples of 8, Adam, as two pipeline stages.
    "DeepSpeedExamples__training.pipeline_parallelism.ds_config.json",
]


def with_tiny_gpt(name: str, directory: Path) -> Path:
    """The corpus file's DeepSpeed keys, unchanged, with configs/tiny_gpt.json's engine sections."""
    tiny = json.loads((ROOT / "configs" / "tiny_gpt.json").read_text())
    engine = {key: tiny[key] for key in ("model", "data", "trainer")}
    if "pipeline" in name:
        engine["parallel"] = {"pipeline_parallel_size": 2}
    path = directory / name
    path.write_text(json.dumps({**json.loads((CORPUS / name).read_text()), **engine}))
    return path


@pytest.mark.launch
@pytest.mark.parametrize("name", TRAINED, ids=[name.split("__")[0] + "-" + name.split(".")[-2] for name in TRAINED])
def test_a_real_deepspeed_config_trains_as_one_process(name: str, tmp_path: Path):
    config = with_tiny_gpt(name, tmp_path)
    run = launch(str(config), {}, tmp_path / "run", nproc=2)
    reference = reference_run(str(config), {}, world_size=2)
    assert len(run.losses) == 5
    assert max_loss_difference(run.losses, reference.losses) <= LOSS_TOLERANCE, (run.losses, reference.losses)
    assert run.losses[-1] < run.losses[0]
    assert_weights_match(run.exported_state_dict(), reference.model, CLIPPED_WEIGHT_TOLERANCE)
