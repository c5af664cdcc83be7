"""What keeps a step from waiting on the device, in-process: the counter that finds host reads
(bench/host_syncs.py), the decoder forward with its loss inside and no read of the device, a whole
step compiled without a graph break, the non-finite check kept on the device, DeepSpeed's ZeRO norm
reads deferred, the single-rank route and DeepSpeed's throughput timer off. The counts per layout,
against a minimal loop, are benchmark 8 (`python -m bench hostcost`)."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime import utils as deepspeed_utils
from deepspeed.runtime.zero import stage3, stage_1_and_2

from bench.host_syncs import HostCounter
from engine.backends import zero_checks
from engine.backends.prefetch import DevicePrefetcher
from engine.config import load_config
from engine.failures.nonfinite import DeferredHealth, StepHealth
from engine.launch.hardware import Hardware
from engine.observability.step_phases import PhaseTimer
from models import get_family
from models.attention import CAUSAL_SDPA
from models.decoder_pipeline import pipeline_loss
from tests.support.launch import ROOT

GPT_CONFIG = ROOT / "configs" / "tiny_gpt.json"
ONE_CPU = Hardware("cpu", bf16_supported=True, fp16_supported=False, cpu_count=2, local_world_size=1)
DECODERS = {
    "gpt": {"family": "gpt", "preset": "tiny", "vocab_size": 65},
    "llama": {"family": "llama", "preset": "tiny", "vocab_size": 65},
}


def decoder(name: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return get_family(name).build({**DECODERS[name], **overrides})


def batch(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 65, (2, 16), generator=generator)
    labels = torch.randint(0, 65, (2, 16), generator=generator)
    labels[0, :3] = -100
    return {"input_ids": input_ids, "labels": labels}


def test_the_counter_finds_every_kind_of_host_read_and_skips_host_side_values():
    x, tolist = torch.arange(4.0), torch.Tensor.tolist
    with HostCounter() as counter:
        x.sum().item()
        bool(x.max() > 2)
        x.tolist()
        x.cpu()
        from deepspeed.accelerator import get_accelerator

        get_accelerator().synchronize()
    assert counter.syncs == {"scalar read": 2, "Tensor.tolist": 1, "Tensor.cpu": 1, "synchronize": 1}
    # torch's single-tensor Adam reads its step count, which it keeps on the host on every device.
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([parameter], foreach=False)
    with HostCounter() as counter:
        optimizer.step()
        y = x.view(2, 2).t()  # views launch no kernel
    assert counter.total_syncs == 0 and y.shape == (2, 2)
    assert torch.Tensor.tolist is tolist  # restored on exit


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_the_decoder_computes_its_loss_in_its_forward_without_reading_the_device(name: str):
    family, model, data = get_family(name), decoder(name), batch()
    assert model.config._attn_implementation == CAUSAL_SDPA
    with HostCounter() as counter:
        loss = family.compute_loss(model, data)
    assert counter.total_syncs == 0
    expected = pipeline_loss(model(input_ids=data["input_ids"], use_cache=False).logits, data["labels"])
    assert torch.equal(loss, expected)
    # The same kernel transformers' own "sdpa" chooses for unpadded windows: equal logits.
    reference = decoder(name, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(reference(input_ids=data["input_ids"]).logits, model(input_ids=data["input_ids"]).logits)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_a_whole_training_step_compiles_as_one_graph(name: str):
    """fullgraph=True raises at the first graph break: forward, loss and backward trace whole."""
    torch._dynamo.reset()
    family, model = get_family(name), decoder(name)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    family.compute_loss(compiled, batch()).backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


def test_deferred_health_names_the_first_bad_step_without_a_host_read():
    health = DeferredHealth(torch.device("cpu"))
    finite, nan = torch.tensor(1.0), torch.tensor(float("nan"))
    with HostCounter() as counter:
        health.record(1, finite, torch.tensor(False), dropped=False)
        health.record(2, finite, None, dropped=False)
    assert counter.total_syncs == 0 and health.read() is None
    health.record(3, finite, torch.tensor(True), dropped=False)
    health.record(4, nan, torch.tensor(True), dropped=True)
    assert health.read() == (3, StepHealth(nonfinite_loss_ranks=0, update_dropped=True))
    health = DeferredHealth(torch.device("cpu"))
    health.record(5, nan, None, dropped=False)
    health.record(6, nan, None, dropped=True)
    assert health.read() == (5, StepHealth(nonfinite_loss_ranks=1, update_dropped=False))


def test_zero_norm_reads_are_deferred_only_where_the_policy_allows(monkeypatch: pytest.MonkeyPatch):
    zero_checks.check_internals()  # fails loudly when DeepSpeed moves the reads
    for module in zero_checks.READS:
        monkeypatch.setattr(module, "is_invalid_grad_norm", deepspeed_utils.is_invalid_grad_norm)

    def settings(nonfinite: str, precision: str, stage: int):
        return type("Settings", (), {"nonfinite": nonfinite, "precision": precision, "zero_stage": stage})()

    assert not zero_checks.defer_norm_checks(settings("skip", "bf16", 2))
    assert not zero_checks.defer_norm_checks(settings("stop", "fp16", 2))
    assert not zero_checks.defer_norm_checks(settings("stop", "fp32", 0))
    assert stage_1_and_2.is_invalid_grad_norm is deepspeed_utils.is_invalid_grad_norm
    assert zero_checks.defer_norm_checks(settings("stop", "bf16", 2))
    with HostCounter() as counter:
        assert not stage_1_and_2.is_invalid_grad_norm(torch.tensor(float("nan")))
        assert not stage3.is_invalid_grad_norm(torch.tensor(-1.0))
    assert counter.total_syncs == 0
    assert stage3.is_invalid_grad_norm(float("inf"))  # a Python number is still judged


def resolved(overrides: list[str], world_size: int = 1):
    return load_config(GPT_CONFIG, overrides, world_size=world_size, hardware=ONE_CPU)


def test_one_rank_runs_zero0_and_autocast_where_nothing_is_sharded():
    config = resolved(["zero_optimization.stage=2", "bf16.enabled=true"])
    assert config.zero_stage == 0 and config.autocast and config.precision == "fp32"
    assert config.rerouted == (
        "one rank, nothing to shard: zero_optimization.stage 2 runs as 0; bf16 runs as torch_autocast (fp32 "
        "weights, bf16 products)"
    )
    kept = {
        "asked off": (["trainer.single_rank_fast_path=false"], 1),
        "offload": (["zero_optimization.offload_optimizer.device=cpu"], 1),
        "skip needs DeepSpeed's dropping optimizer": (["trainer.nonfinite=skip"], 1),
        "two ranks": (["train_batch_size=auto"], 2),
    }
    for case, (extra, world) in kept.items():
        config = resolved(["zero_optimization.stage=2", "bf16.enabled=true", *extra], world)
        assert config.zero_stage == 2 and config.precision == "bf16" and not config.rerouted, case
    accelerate = resolved(["zero_optimization.stage=3", "trainer.backend=accelerate"])
    assert accelerate.zero_stage == 3 and not accelerate.rerouted


def test_one_rank_keeps_fp16_as_written():
    """fp16's loss scaler, masters and checkpoint belong to its stage: the route leaves it alone."""
    gpu = Hardware("cuda", bf16_supported=True, fp16_supported=True, cpu_count=16, local_world_size=1, name="H100")
    config = load_config(GPT_CONFIG, ["zero_optimization.stage=2", "fp16.enabled=true"], world_size=1, hardware=gpu)
    assert config.zero_stage == 2 and config.precision == "fp16" and not config.rerouted


def test_deepspeed_timers_and_overflow_reads_are_off_unless_asked():
    config = resolved(["trainer.single_rank_fast_path=false", "bf16.enabled=true", "zero_optimization.stage=2"])
    ds_config = config.deepspeed_config()
    assert ds_config["timers"] == {"throughput": {"enabled": False, "synchronized": True}}
    assert ds_config["bf16"]["check_grad_overflow"] is False
    skip = resolved(["trainer.nonfinite=skip", "bf16.enabled=true", "zero_optimization.stage=2"])
    assert skip.deepspeed_config()["bf16"]["check_grad_overflow"] is True
    asked = resolved(["timers.throughput.enabled=true"]).deepspeed_config()["timers"]["throughput"]
    assert asked["enabled"] is True


def test_phases_sum_over_micro_batches_and_cpu_batches_pass_through():
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.phase("forward"):
            pass
    assert list(timer.seconds) == ["forward"] and timer.seconds["forward"] >= 0
    batches = iter([{"input_ids": torch.ones(2, dtype=torch.long), "pixels": torch.ones(2)}] * 2)
    prefetched = list(DevicePrefetcher(batches, torch.device("cpu"), torch.bfloat16))
    assert len(prefetched) == 2 and prefetched[0]["pixels"].dtype == torch.bfloat16
    assert prefetched[0]["input_ids"].dtype == torch.long


def test_bf16_auto_autocasts_where_deepspeed_would_wrap_it_without_zero():
    gpus = Hardware("cuda", bf16_supported=True, fp16_supported=True, cpu_count=16, local_world_size=2, name="H100")
    two = ["bf16.enabled=auto", "train_batch_size=auto"]

    def precision(extra: list[str]) -> tuple[bool, bool]:
        config = load_config(GPT_CONFIG, [*two, *extra], world_size=2, hardware=gpus)
        return config.document["bf16"]["enabled"], config.autocast

    assert precision(["zero_optimization.stage=0"]) == (False, True)
    assert precision(["zero_optimization.stage=1"]) == (True, False)
    assert precision(["zero_optimization.stage=1", "parallel.pipeline_parallel_size=2"]) == (True, False)
    assert precision(["zero_optimization.stage=0", "trainer.backend=accelerate"]) == (True, False)
    assert precision(["zero_optimization.stage=0", "bf16.enabled=true"]) == (True, False)  # as written
