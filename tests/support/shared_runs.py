"""Runs that several launched test files read, each trained once per session (the `trained` fixture
of tests/launched/conftest.py): a parity row holds one to the single-process reference, a resume test
continues it on its own layout and a reshape test on another. A launch costs the 2-core CI machine
10-30 s, most of it start-up, so one run proving three things is what keeps the suite within its time.

A test reads a shared run and never changes what it wrote, except the universal form a resume on
another layout adds beside the checkpoint, as any resume does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.launch import Run, launch, launch_accelerate, launch_script

GPT, LLAMA, RESNET = "configs/tiny_gpt.json", "configs/llama_tiny.json", "configs/tiny_resnet.json"


def warm_up(floor: float, peak: float) -> dict:
    """A warm-up over four steps, so a resume at step 4 that lost the scheduler's state would show in
    the learning rate; from a floor above 0, so that every step trains."""
    return {"type": "WarmupLR", "params": {"warmup_min_lr": floor, "warmup_max_lr": peak, "warmup_num_steps": 4}}


# Six steps, saved at step 3: resumes train steps 4-6 from it. One thread per rank under every
# launcher (accelerate launch sets OMP_NUM_THREADS=1 and the deepspeed launcher does not), so that a
# run under either launcher reduces in the same order.
GPT_STEPS = {
    "trainer.max_steps": 6,
    "trainer.save_interval": 3,
    "trainer.threads_per_rank": 1,
    "gradient_clipping": 1.0,
    "scheduler": warm_up(1e-4, 1e-3),
}
# The tiny ResNet's parity holds at lr 1e-4 (docs/design/models.md, "The tiny ResNet of the tests"), the peak.
RESNET_STEPS = {"trainer.max_steps": 6, "trainer.save_interval": 3, "scheduler": warm_up(2.5e-5, 1e-4)}
# ResNet's data-parallel rows run unclipped, as the parity matrix's ResNet rows do (test_parity.py).
RESNET_UNCLIPPED = {**RESNET_STEPS, "gradient_clipping": 0.0}
# Two pipeline stages of two tensor shards each; ZeRO-1, the stage pipelines allow and reshape from.
PP2_TP2 = {"zero_optimization.stage": 1, "parallel.pipeline_parallel_size": 2, "parallel.tensor_parallel_size": 2}


@dataclass(frozen=True)
class SharedRun:
    config: str
    training: dict  # what a resume of the run repeats
    layout: dict  # what a resume on another layout changes
    nproc: int = 2
    accelerate: bool = False  # the accelerate backend (`accelerate launch`), else DeepSpeed (`deepspeed`)
    hf_tokenizer: bool = False  # trains on tests/conftest.py's byte-level BPE (data.tokenizer)
    # Trained through ./launch.sh with that launcher (test_training.py reads what it printed); its
    # resumes are started by the launcher itself.
    launch_script: bool = False

    def launch(self, overrides: dict, output_dir: Path) -> Run:
        """A run of `overrides` on this run's config, launcher and process count."""
        if self.accelerate:
            return launch_accelerate(self.config, overrides, output_dir, nproc=self.nproc)
        return launch(self.config, overrides, output_dir, nproc=self.nproc)


SHARED_RUNS = {
    "gpt_zero0": SharedRun(GPT, GPT_STEPS, {"zero_optimization.stage": 0}),
    "gpt_zero2": SharedRun(GPT, GPT_STEPS, {"zero_optimization.stage": 2}),
    # Its checkpoints hold DeepSpeed's gathered weights too, saved in the background
    # (test_checkpoints_launched.py reads them); neither changes what it trains.
    "gpt_zero3": SharedRun(
        GPT,
        GPT_STEPS,
        {
            "zero_optimization.stage": 3,
            "zero_optimization.stage3_gather_16bit_weights_on_model_save": True,
            "trainer.async_save": True,
        },
    ),
    "gpt_fsdp": SharedRun(GPT, GPT_STEPS, {"zero_optimization.stage": 3}, accelerate=True),
    "gpt_pp2_tp2": SharedRun(GPT, GPT_STEPS, PP2_TP2, nproc=4),
    "llama_pp2_tp2": SharedRun(LLAMA, GPT_STEPS, PP2_TP2, nproc=4, hf_tokenizer=True),
    "resnet_zero2": SharedRun(RESNET, RESNET_UNCLIPPED, {"zero_optimization.stage": 2}, launch_script=True),
    "resnet_fsdp": SharedRun(
        RESNET, RESNET_UNCLIPPED, {"zero_optimization.stage": 3}, accelerate=True, launch_script=True
    ),
    "resnet_pp2": SharedRun(RESNET, RESNET_STEPS, {"zero_optimization.stage": 1, "parallel.pipeline_parallel_size": 2}),
}


@dataclass(frozen=True)
class Trained:
    """A shared run as launched: its spec, its training overrides with paths filled in, what it wrote."""

    spec: SharedRun
    training: dict
    run: Run

    @property
    def config(self) -> str:
        return self.spec.config

    @property
    def overrides(self) -> dict:
        return {**self.training, **self.spec.layout}

    def launch_again(self, overrides: dict, output_dir: Path) -> Run:
        """A run of `overrides` on this run's config, launcher and process count (a resume of it)."""
        return self.spec.launch(overrides, output_dir)


def train_shared(spec: SharedRun, output_dir: Path, hf_tokenizer_dir: Path) -> Trained:
    training = {**spec.training, "data.tokenizer": str(hf_tokenizer_dir)} if spec.hf_tokenizer else spec.training
    overrides = {**training, **spec.layout}
    if spec.launch_script:
        launcher = "accelerate" if spec.accelerate else "deepspeed"
        return Trained(spec, training, launch_script(launcher, spec.config, overrides, output_dir, spec.nproc))
    return Trained(spec, training, spec.launch(overrides, output_dir))
