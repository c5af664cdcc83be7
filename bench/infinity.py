"""Benchmark 5's `offload` on a machine without a GPU: the largest GPT that trains with ZeRO-Infinity
(ZeRO-3 with its parameters and optimizer states swapped to NVMe, `offload_param.max_in_cpu` 0)
under a fixed cap on host memory, against ZeRO-3 with both offloaded to host memory under the same
cap, and the step time of each. Goal: NVMe trains a model at least twice as large.

One rank, fp32, synthetic tokens from a 65-symbol vocabulary (the character tokenizer's, so the
largest parameter is an MLP matrix, not the embedding), micro-batch 1 at sequence 64, 3 steps and
one evaluation batch. Both sides take the same ZeRO-3 settings but where the states live: a
sub-group and a parameter swap buffer of the largest parameter's elements, and each parameter
fetched when its module runs and released after it, since prefetching or keeping parameters for
their reuse holds more swapped partitions than the swapper has buffers (DeepSpeed 0.19.8 fails at
the second step with "Not enough buffers 0 for swapping 1" on 24 layers at width 1024).

The cap is RLIMIT_AS, set in the launcher's process before it starts and inherited by its rank: an
allocation beyond it fails in the rank with a traceback, where a cgroup's limit would have the
kernel's OOM killer end a process without one; it needs neither root nor cgroup v1, and no page
cache or reclaim moves it. It counts address space, which a rank reserves more of than it touches
(2.6 GiB of virtual memory for 0.6 GiB resident in a tiny run), so the cap is the larger peak of a
tiny run of either side (/proc's VmPeak) plus a fixed budget: what both sides may spend on the model.
Sizes whose planned host bytes (`engine.plan`) exceed the budget are not launched; the rest are
launched from the largest down until one trains.
"""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from bench import gpu
from bench.machine import machine_facts
from bench.memory import parameter_count
from bench.results import Goal, Result, Unavailable, compare
from bench.settings import Settings
from bench.trials import ROOT, RUNS, read_records, run_overrides
from engine.config import EngineConfig, load_config
from engine.launch.hardware import detect_hardware
from engine.parallel.process_group import free_port
from engine.plan import plan_run
from engine.plan.shapes import build_on_meta
from engine.preflight import check_data
from models import get_family

CONFIG = ROOT / "configs" / "shakespeare_char.json"
BUDGET = 2 * 2**30  # host memory each side may spend on the model above a tiny run's peak
STEPS = 3
TINY = (4, 128, 4)  # benchmark 3's model: 0.8M parameters, none large enough to swap
# (layers, width, heads), largest first: one width, so the largest parameter, and with it the swap
# buffers, is the same in every size and the sizes step by a layer's 12.6M parameters.
SIZES = [(layers, 1024, 16) for layers in (32, 24, 20, 16, 14, 12, 10, 8, 6, 5, 4, 3, 2)]
COMMON = [
    "data.type=synthetic",
    "model.vocab_size=65",
    "bf16.enabled=false",
    "train_micro_batch_size_per_gpu=1",
    "gradient_accumulation_steps=1",
    "train_batch_size=1",
    "scheduler.params.warmup_num_steps=2",
    "zero_optimization.stage=3",
    "zero_optimization.stage3_prefetch_bucket_size=0",
    "zero_optimization.stage3_max_reuse_distance=0",
]
CPU_OFFLOAD, NVME = "ZeRO-3, CPU offload", "ZeRO-3, NVMe offload"
TRIAL_TIMEOUT_S = 900  # a rank whose helper thread the cap refused may wait forever
# A rank's address space grows in its last moments too (threads at its save and exit), so VmPeak is
# read often, of processes listed less often: the listing walks every process of the machine.
POLL_S, LIST_S = 0.05, 1.0
# glibc's defaults would make the cap charge address space that holds no live tensor: a malloc arena
# (64 MiB reserved) for each thread that finds the others' busy, up to 8 per core, in a number that
# varies run to run (the tiny run's peak moved by 0.4 GiB); and freed blocks of up to 32 MiB kept in
# its heaps, as its mmap threshold rises to the largest block freed (NVMe at 151M parameters peaked at
# 4.88 GiB with the default, 3.66 GiB with the threshold held at 1 MiB). Both sides run with both held.
MALLOC = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
_REFUSED = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")  # torch's CPU allocator


@dataclass(frozen=True)
class Trial:
    """One size of one side: what it trained under the cap, or why it did not."""

    size: tuple[int, int, int]
    parameters: int
    seconds_per_step: float | None  # None: it did not train
    peak: int  # the largest VmPeak among the launch's processes; 0 where it was not launched
    error: str = ""  # why it did not train, or was not launched

    def describe(self) -> str:
        name = f"{self.size} {self.parameters / 1e6:.0f}M"
        if self.seconds_per_step is None:
            return f"{name}: {self.error}"
        return f"{name}: trained, {self.seconds_per_step:.2f} s/step, peak {self.peak / 2**30:.2f} GiB"


def run(settings: Settings) -> Result:
    """The GPU benchmark (`bench.gpu.offload`) where there is a GPU, the CPU comparison elsewhere."""
    if torch.cuda.is_available():
        return gpu.offload(settings)
    return compare_offload(settings)


def compare_offload(settings: Settings) -> Result:
    if not sys.platform.startswith("linux"):
        raise Unavailable("needs Linux: the cap is RLIMIT_AS and the peak /proc's VmPeak")
    overrides = run_overrides(STEPS, 1, eval_batches=1, threads=settings.threads)
    tiny = {mode: launch(mode, TINY, overrides, cap=None) for mode in (CPU_OFFLOAD, NVME)}
    for mode, trial in tiny.items():
        if trial.seconds_per_step is None:
            raise RuntimeError(f"{mode}'s tiny run, uncapped, did not train: {trial.error}")
    base = max(trial.peak for trial in tiny.values())
    cap = base + BUDGET
    print(f"  tiny runs' peak {base / 2**30:.2f} GiB: cap {cap / 2**30:.2f} GiB", flush=True)
    searched = {mode: largest_trained(mode, overrides, cap) for mode in (CPU_OFFLOAD, NVME)}
    cpu, nvme = (searched[mode][-1] for mode in (CPU_OFFLOAD, NVME))
    if cpu.seconds_per_step is None or nvme.seconds_per_step is None:
        raise RuntimeError(f"a side trained no size under the cap of {cap / 2**30:.2f} GiB. {tried(searched)}")
    rows = [
        compare("parameters trained", cpu.parameters, nvme.parameters, Goal("ratio", ">=", 2.0)),
        compare("seconds per step, each at its largest", cpu.seconds_per_step, nvme.seconds_per_step),
    ]
    # The same model both ways: what swapping costs a step, apart from the size it buys.
    same = launch(NVME, cpu.size, overrides, cap)
    print(f"  {NVME} at {CPU_OFFLOAD}'s largest: {same.describe()}", flush=True)
    failures = {}
    if same.seconds_per_step is None:
        failures[f"{NVME} at {CPU_OFFLOAD}'s largest size"] = same.error
    else:
        label = f"seconds per step at {cpu.parameters / 1e6:.0f}M"
        rows.append(compare(label, cpu.seconds_per_step, same.seconds_per_step))
    return Result(
        name="offload",
        title="The largest GPT that trains under a host-memory cap: ZeRO-3 with NVMe offload against CPU offload",
        baseline=CPU_OFFLOAD,
        method=method(base, cap, searched, same),
        rows=rows,
        panels=[],
        machine=machine_facts(settings.threads),
        failures=failures,
    )


def largest_trained(mode: str, overrides: list[str], cap: int) -> list[Trial]:
    """`mode`'s trials from the largest size down to the first that trains (the last), the sizes
    the planner puts over the budget included, not launched."""
    trials = []
    for size in SIZES:
        sets = sized(mode, size, trial_dir(mode, size), overrides)
        planned = plan_run(check_data(load(sets))[0]).host_total
        if planned > BUDGET:
            error = f"planned {planned / 2**30:.2f} GiB, not launched"
            trials.append(Trial(size, parameter_count(CONFIG, sets), None, 0, error))
            continue
        trials.append(launch(mode, size, overrides, cap))
        print(f"  {mode}: {trials[-1].describe()}", flush=True)
        if trials[-1].seconds_per_step is not None:
            break
    return trials


def trial_dir(mode: str, size: tuple[int, int, int]) -> Path:
    return RUNS / "offload" / f"{'nvme' if mode == NVME else 'cpu'}-{'x'.join(map(str, size))}"


def sized(mode: str, size: tuple[int, int, int], run_dir: Path, overrides: list[str]) -> list[str]:
    """The overrides of `mode` at `size`, swapping under `run_dir`/nvme where it swaps."""
    layers, width, heads = size
    shape = [f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"]
    largest = largest_parameter([*COMMON, *shape])
    sets = [*COMMON, *shape, *overrides, f"zero_optimization.sub_group_size={largest}"]
    if mode == CPU_OFFLOAD:
        return [*sets, "zero_optimization.offload_param.device=cpu", "zero_optimization.offload_optimizer.device=cpu"]
    folder = run_dir / "nvme"
    return [
        *sets,
        "zero_optimization.offload_param.device=nvme",
        f"zero_optimization.offload_param.nvme_path={folder}",
        "zero_optimization.offload_param.max_in_cpu=0",
        f"zero_optimization.offload_param.buffer_size={largest}",
        "zero_optimization.offload_optimizer.device=nvme",
        f"zero_optimization.offload_optimizer.nvme_path={folder}",
    ]


def largest_parameter(sets: list[str]) -> int:
    """Elements of the model's largest parameter, counted on the meta device."""
    config = load(sets)
    return max(p.numel() for p in build_on_meta(get_family(config.model.family), config.model.fields).parameters())


def load(sets: list[str]) -> EngineConfig:
    return load_config(CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1))


def launch(mode: str, size: tuple[int, int, int], overrides: list[str], cap: int | None) -> Trial:
    """`mode` at `size` for STEPS steps on one rank, its address space capped at `cap` bytes (None:
    uncapped). Only the log and metrics are kept: the swap folder and the checkpoint (gigabytes) go with the trial."""
    run_dir = trial_dir(mode, size)
    sets = [*sized(mode, size, run_dir, overrides), f"trainer.output_dir={run_dir}"]
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    ports = ["--num_gpus", "1", "--master_port", str(free_port())]
    command = ["deepspeed", *ports, "engine/main.py", "--deepspeed_config", str(CONFIG)]
    code, peak = run_capped([*command, *(arg for value in sets for arg in ("--set", value))], run_dir, cap)
    for scratch in ("nvme", "checkpoints"):
        shutil.rmtree(run_dir / scratch, ignore_errors=True)
    parameters = parameter_count(CONFIG, sets)
    records = read_records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if code != 0 or not records or records[-1]["step"] != STEPS:
        return Trial(size, parameters, None, peak, failure(run_dir / "trial.log", code))
    # Step 1 also records ZeRO-3's trace of the modules; the steps after it are the steady ones.
    later = [record["step_time_s"] for record in records if record["step"] > 1]
    return Trial(size, parameters, sum(later) / len(later), peak)


def run_capped(command: list[str], run_dir: Path, cap: int | None) -> tuple[int | None, int]:
    """`command`'s exit code (None: killed at TRIAL_TIMEOUT_S), its output in `run_dir`/trial.log, each
    of its processes held to `cap` bytes of address space (None: not held); and the largest VmPeak
    among them. VmPeak is the kernel's high-water mark, so polling it misses only what grows in the
    last poll interval of a process. It runs with MALLOC set, which the launcher passes to its ranks."""

    def limit() -> None:
        if cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    peak, family, listed = 0, [], 0.0
    with (run_dir / "trial.log").open("w") as out:
        job = subprocess.Popen(
            command,
            cwd=ROOT,
            env={**os.environ, **MALLOC},
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=limit,
            start_new_session=True,
        )
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while job.poll() is None:
            now = time.monotonic()
            if now > deadline:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                return None, peak
            if now - listed > LIST_S:
                family, listed = _family(job.pid), now
            peak = max([peak, *(_vm_peak(pid) for pid in family)])
            time.sleep(POLL_S)
    return job.returncode, peak


def _family(pid: int) -> list[int]:
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _vm_peak(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it exited between the listing and the read
        return 0
    line = next((line for line in status.splitlines() if line.startswith("VmPeak:")), "VmPeak: 0 kB")
    return int(line.split()[1]) * 1024


def failure(log: Path, code: int | None) -> str:
    """Why a trial did not train, in a line: the rank's error where the engine reports one."""
    if code is None:
        return f"killed after {TRIAL_TIMEOUT_S} s"
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    reported = [line for line in lines if " failed: " in line]
    line = (reported or lines or [f"exit code {code}"])[-1]
    refused = _REFUSED.search(line)
    if refused:
        return f"out of memory ({int(refused.group(1)) / 2**20:,.0f} MiB refused)"
    return line.split(" (full log:")[0][:200]


def tried(searched: dict[str, list[Trial]]) -> str:
    return " ".join(f"{mode}: " + "; ".join(t.describe() for t in trials) + "." for mode, trials in searched.items())


def method(base: int, cap: int, searched: dict[str, list[Trial]], same: Trial) -> str:
    layers, width, heads = SIZES[0]
    largest = largest_parameter([*COMMON, f"model.n_layer={layers}", f"model.n_embd={width}", f"model.n_head={heads}"])
    return (
        f"{CONFIG.relative_to(ROOT)} with {', '.join(COMMON)}; one rank under the deepspeed launcher, {STEPS} "
        f"steps and one evaluation batch. {CPU_OFFLOAD}: offload_param and offload_optimizer on the cpu. {NVME}: "
        "both on NVMe, in a folder under runs/bench removed after each trial, offload_param.max_in_cpu 0 and "
        f"offload_param.buffer_size {largest:,} elements, the largest parameter (an MLP matrix); both sides "
        f"sub_group_size the same. Cap: RLIMIT_AS of {cap / 2**30:.2f} GiB on every process, the larger VmPeak "
        f"of a tiny run of either side ({TINY}: {base / 2**30:.2f} GiB) plus a budget of {BUDGET / 2**30:.0f} "
        "GiB. RLIMIT_AS rather than a cgroup's limit: an allocation beyond it fails in the rank with a "
        "traceback, where the cgroup's OOM killer ends a process without one, and it needs neither root nor "
        "cgroup v1. It counts address space, which a rank reserves more of than it touches: hence the budget "
        "above a tiny run's peak, and glibc held to what is allocated on both sides: MALLOC_ARENA_MAX=2 (its "
        "arenas reserve 64 MiB each, in a number that varies run to run) and MALLOC_MMAP_THRESHOLD_=1 MiB "
        "(its rising threshold keeps freed blocks of up to 32 MiB in its heaps). Sizes (layers, width, "
        "heads) from the largest down, until one trains; those whose planned host bytes (`python -m engine "
        f"plan`) exceed the budget are not launched. {tried(searched)} "
        "Seconds per step: the mean of steps 2 and 3 (step 1 also records ZeRO-3's trace of the modules). The "
        f"last row is {NVME} at {CPU_OFFLOAD}'s largest size: {same.describe()}. Of the 24 bytes a parameter "
        "that CPU offload holds in host memory (fp32 parameter, gradient, its offloaded copy, master weight and "
        "two moments), NVMe moves 20; the fp32 gradient partition that ZeRO-3 keeps on the device stays, as on "
        "a CPU the device is the host, beside the working set of gathered parameters, activations and swap "
        "buffers."
    )
