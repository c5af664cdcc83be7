"""The benchmark harness without running a benchmark (speed is never asserted in tests): every
config a benchmark launches validates, the ZeRO formulas reproduce the paper's figure, the report
renders, and a benchmark this machine cannot run is passed over without failing the others."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import bench.__main__ as bench_main
import bench.report as report
from bench import (
    data,
    gpu,
    hostcost,
    infinity,
    memory,
    memory_walls,
    nanogpt,
    optimizer_step,
    sequence,
    sft,
    shakespeare,
    throughput,
    trl_sft,
)
from bench.results import Goal, Panel, Result, Unavailable, compare
from bench.trials import Pair, Side, run_overrides
from data.chat.render import chat_format
from data.corpus import CHAT_SAMPLE
from data.loader import MicroBatchSampler
from engine.config import load_config
from engine.launch.hardware import detect_hardware
from engine.preflight import check_data
from tests.support.benchmarks import embedded_source  # noqa: F401 (a fixture: pytest finds it by name)

RUN = run_overrides(steps=300, log_interval=25, eval_batches=1, threads=1)  # python -m bench's defaults
MEMORY_RUN = run_overrides(memory.STEPS, 1, eval_batches=1, threads=1)
OFFLOAD_RUN = run_overrides(3, 1, eval_batches=1, threads=1)
GPU_RUN = run_overrides(60, 10, eval_batches=1, threads=1)  # the fewest steps bench/gpu.py runs
LAUNCHED = [
    pytest.param(throughput.CONFIG, ["data.type=synthetic", *RUN], 1, id="overhead"),
    pytest.param(shakespeare.CONFIG, ["data.type=synthetic", *run_overrides(2000, 100, 145, 1)], 1, id="shakespeare"),
    *(
        pytest.param(memory.CONFIG, [*memory.COMMON, *layout, *MEMORY_RUN], memory.RANKS, id=f"memory-{name}")
        for name, layout in memory.LAYOUTS.items()
    ),
    *(
        pytest.param(subject.config, [*subject.common, *sets, *GPU_RUN], 1, id=f"gpu-{subject.label}-{name}")
        for subject in gpu.SUBJECTS
        for name, sets in subject.variants.items()
    ),
    *(
        pytest.param(
            optimizer_step.CONFIG,
            [*optimizer_step.COMMON, *sets, *run_overrides(optimizer_step.STEPS, optimizer_step.LOG_INTERVAL, 1, 1)],
            1,
            id=f"optimizer-{route}",
        )
        for route, sets in optimizer_step.ROUTES.items()
    ),
    *(
        pytest.param(
            hostcost.CONFIG, [*hostcost.COMMON, *layout.overrides], layout.processes, id=f"hostcost-{layout.name}"
        )
        for layout in hostcost.LAYOUTS
    ),
    *(
        pytest.param(
            gpu.CONFIG,
            [
                *gpu.OFFLOAD,
                *gpu.OFFLOADED,
                f"model.n_layer={n}",
                f"model.n_embd={e}",
                f"model.n_head={h}",
                *OFFLOAD_RUN,
            ],
            1,
            id=f"offload-{n}x{e}",
        )
        for n, e, h in gpu.OFFLOAD_SIZES
    ),
    *(
        pytest.param(
            infinity.CONFIG,
            infinity.sized(mode, size, infinity.trial_dir(mode, size), OFFLOAD_RUN),
            1,
            id=f"offload-{'nvme' if mode == infinity.NVME else 'cpu'}-{size[0]}x{size[1]}",
        )
        for mode in (infinity.CPU_OFFLOAD, infinity.NVME)
        for size in [infinity.TINY, *infinity.SIZES]
    ),
    *(
        pytest.param(
            sequence.CONFIG, sequence.launch_sets(degree, length, 1), degree, id=f"sequence-sp{degree}-{length}"
        )
        for degree in sequence.DEGREES
        for length in (sequence.REFERENCE, *sequence.LENGTHS)
    ),
    *(
        pytest.param(memory_walls.CONFIG, point.sets(1), 1, id=f"memory-walls-{point.name}")
        for point in memory_walls.points()
    ),
]


@pytest.mark.parametrize(("config", "sets", "world_size"), LAUNCHED)
def test_every_benchmark_config_validates(config: Path, sets: list[str], world_size: int) -> None:
    """Each benchmark's config with the overrides its runs get: a typo or a schedule longer than
    the run would otherwise surface only on the machine that runs it (the GPU benchmarks on a GPU),
    after minutes of other benchmarks."""
    hardware = detect_hardware(local_world_size=world_size)
    loaded = load_config(config, sets, world_size=world_size, hardware=hardware)
    assert loaded.trainer.output_dir


@pytest.mark.parametrize(("mebibytes", "trains"), [(256, True), (768, False)])
def test_capped_run_holds_the_launchers_children_and_reads_their_peak(
    tmp_path: Path, mebibytes: int, trains: bool
) -> None:
    """The offload benchmark's cap is set in the launcher before it starts, so the rank it starts
    inherits it: a child allocating beyond it fails, and the peak read from /proc is the child's."""
    child = f"import time; block = bytearray({mebibytes} * 2**20); time.sleep(2 * {infinity.LIST_S})"
    parent = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {child!r}]))"
    code, peak = infinity.run_capped([sys.executable, "-c", parent], tmp_path, cap=512 * 2**20)
    assert (code == 0) is trains, (tmp_path / "trial.log").read_text()
    if trains:
        assert mebibytes * 2**20 < peak <= 512 * 2**20
    else:
        assert "MemoryError" in (tmp_path / "trial.log").read_text()


def test_zero_formulas_reproduce_the_papers_figure() -> None:
    """Rajbhandari et al. 2020, figure 1: 7.5B parameters on 64 GPUs hold 120 GB per GPU without
    ZeRO, 31.4 GB with optimizer-state partitioning, 16.6 GB adding gradients, 1.9 GB adding
    parameters."""
    totals = [sum(memory.zero_formula(stage, 7_500_000_000, 64).values()) / 1e9 for stage in range(4)]
    assert [round(total, 1) for total in totals] == [120.0, 31.4, 16.6, 1.9]


def test_parameter_count_counts_a_tied_weight_once() -> None:
    # GPT-2 124M with its own vocabulary: the published 124,439,808 (the head shares the embedding).
    count = memory.parameter_count(gpu.CONFIG, ["data.type=synthetic", "model.vocab_size=50257"])
    assert count == 124_439_808


def _result(name: str) -> Result:
    goal = Goal("ratio", ">=", 0.97)
    return Result(
        name=name,
        title="a title",
        baseline="base",
        method="how",
        rows=[compare("tokens/s", 100.0, 99.0, goal), compare("ms per step", 10.0, 10.1)],
        panels=[Panel("p", "round", "tokens/s", {"base": ([1, 2], [100.0, 101.0])}, goal_line=None)],
        machine={"date": "2026-11-22 12:00 UTC", "cpu": "cpu", "cores": 2, "threads": 2},
    )


@pytest.fixture
def report_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(report, "STORE", tmp_path / "results.json")
    monkeypatch.setattr(report, "REPORT", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "PLOT", tmp_path / "benchmarks.png")
    monkeypatch.setattr(bench_main, "REPORT", tmp_path / "benchmarks.md")
    return tmp_path


def test_report_renders_rows_verdicts_and_plot(report_paths: Path) -> None:
    history = [report.headline(_result("overhead"))]
    report.write_report([_result("overhead")], history)
    text = (report_paths / "benchmarks.md").read_text()
    assert "| tokens/s | 100 | 99 | 0.990 | ratio >= 0.97 | yes |" in text
    assert "| ms per step | 10 | 10.1 | 1.010 | — | — |" in text
    assert "| 2026-11-22 12:00 UTC | overhead | — |  | tokens/s | 100 | 99 | 0.990 |" in text
    assert (report_paths / "benchmarks.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quality-rounds", "0"], "argument --quality-rounds: must be at least 1, got 0"),
        (["--threads", "two"], "argument --threads: expected a whole number, got 'two'"),
        (["--steps", "40", "--log-interval", "25"], "--steps must be at least twice --log-interval"),
        (["nosuch"], "unknown benchmark nosuch"),
    ],
)
def test_bad_bench_arguments_get_a_usage_error(argv: list[str], message: str, capsys) -> None:
    """Before anything runs: zero rounds once reached a StatisticsError from an empty median."""
    with pytest.raises(SystemExit) as exit_info:
        bench_main.parse_settings(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_unavailable_benchmark_is_passed_over(report_paths: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def needs_gpu(settings):
        raise Unavailable("needs a CUDA GPU")

    monkeypatch.setitem(bench_main.BENCHMARKS, "gpu", needs_gpu)
    monkeypatch.setitem(bench_main.BENCHMARKS, "overhead", lambda settings: _result("overhead"))
    assert bench_main.main(["overhead", "gpu"]) == 0
    assert "gpu: not run on this machine: needs a CUDA GPU" in capsys.readouterr().out
    stored = json.loads((report_paths / "results.json").read_text())
    assert set(stored["results"]) == {"overhead"}
    assert [entry["benchmark"] for entry in stored["history"]] == ["overhead"]


def test_failed_gpu_variant_keeps_the_others_figures_and_fails_the_run(
    report_paths: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A variant that does not train (a kernel or compile error on the lent GPU) is reported with
    its error; the variants that trained keep their rows, and the run exits 1."""
    pair = Pair(engine=Side(0.05, 327_680.0, [], None), baseline=Side(0.04, 409_600.0, [], None), ratio=0.8, machine={})
    failed = "compiled, SDPA, activation checkpointing"
    error = "python -m bench.paired torch ... exited 1; log trial.log:\nrank 0 failed: AttributeError: no such method"
    measured = {"GPT-2 124M": {"eager, SDPA": [pair]}}
    result = gpu.speed_result(measured, {failed: error}, 60, flops={"GPT-2 124M": 10**9}, peak=10**15)
    assert [row.quantity for row in result.rows] == [
        "GPT-2 124M, eager, SDPA: tokens/s",
        "GPT-2 124M, eager, SDPA: MFU",
    ]
    assert result.rows[0].goal == "ratio >= 0.98" and result.rows[0].met is False
    assert result.rows[1].engine == pytest.approx(327_680.0 * 10**9 / 10**15)
    monkeypatch.setitem(bench_main.BENCHMARKS, "gpu", lambda settings: result)
    assert bench_main.main(["gpu"]) == 1
    assert f"{failed}: FAILED, no figures: rank 0 failed: AttributeError: no such method" in capsys.readouterr().out
    text = (report_paths / "benchmarks.md").read_text()
    assert f"**Failed, without figures:** {failed}." in text and "rank 0 failed: AttributeError" in text
    assert set(json.loads((report_paths / "results.json").read_text())["results"]) == {"gpu"}


def test_nanogpt_reference_is_the_baby_gpt_and_learns() -> None:
    """bench/nanogpt.py restates nanoGPT's model: on benchmark 3's recipe it has the 0.80M
    parameters nanoGPT reports (795,904, position embeddings not counted as nanoGPT counts), and
    its loop, validated on the engine's samples, learns a short repetitive text."""
    recipe = json.loads(shakespeare.CONFIG.read_text())
    arch = recipe["model"]
    model = nanogpt.GPT(65, recipe["data"]["seq_len"], arch["n_layer"], arch["n_head"], arch["n_embd"])
    assert sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel() == 795_904
    text = "the quick brown fox jumps over the lazy dog. " * 250
    vocabulary = len(set(text))
    result = nanogpt.train(
        {**recipe, "scheduler": {"params": {"warmup_num_steps": 5, "cos_min_ratio": 0.1}}}, text, 40, 0, 10
    )
    assert result["eval_loss"] < 0.5 * math.log(vocabulary)


@pytest.mark.parametrize("ranks", data.RANKS)
@pytest.mark.usefixtures("embedded_source")
def test_data_benchmark_launches_validate(tmp_path: Path, ranks: int) -> None:
    """The data benchmark's launch on a corpus it makes, checked as launch.sh's `validate` checks it
    (the corpus is tokenized and fills a batch): its configs need a real file, so they are not in
    LAUNCHED."""
    corpus = data.make_corpus(0.2, tmp_path / "corpus.txt")
    assert corpus.stat().st_size == 200_000
    sets = data.launch_sets(corpus, tmp_path / "cache", threads=1)
    config = load_config(data.CONFIG, sets, world_size=ranks, hardware=detect_hardware(local_world_size=ranks))
    assert check_data(config)[0].data.tokenizer == "byte"


@pytest.mark.parametrize(
    "value, sizes",
    [(None, data.SIZES_MB), ("3,0.5", (0.5, 3.0)), ("1", None), ("1,1", None), ("0,1", None), ("1,two", None)],
)
def test_data_benchmark_sizes_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str | None, sizes: tuple[float, ...] | None
) -> None:
    """Two sizes at least: the launch and memory rows compare each corpus with the smallest."""
    if value is None:
        monkeypatch.delenv(data.SIZES_ENV, raising=False)
    else:
        monkeypatch.setenv(data.SIZES_ENV, value)
    if sizes is None:
        with pytest.raises(RuntimeError, match=data.SIZES_ENV):
            data.sizes_mb()
    else:
        assert data.sizes_mb() == sizes


@pytest.fixture(scope="session")
def sft_base(tmp_path_factory) -> Path:
    """The tiny Llama the sft benchmark fine-tunes, written as the benchmark writes it."""
    return sft.base_model(tmp_path_factory.mktemp("sft"))


def test_sft_windows_time_neither_start_up_nor_the_final_evaluation() -> None:
    """Seven steps logged in windows of two: steps 3-4 and 5-6 are timed by the clock at steps 2, 4
    and 6; steps 1-2 hold start-up, and step 7's record waits for the engine's final evaluation."""
    trial = sft.Trial(times=[0.0, 10.0, 11.0, 13.0, 14.0, 18.0, 99.0], losses=[0.0] * 7, tokens=[5, 5, 6, 10, 4, 4, 5])
    assert sft.window_rates(trial, 2) == [(6 + 10) / 3.0, (4 + 4) / 5.0]


def test_sft_counts_the_conversation_tokens_of_the_engines_own_batches() -> None:
    """A packed window counts its conversations' tokens, not its padding, and each step sums the
    windows the engine's sampler (data/loader.py) draws for it, across epochs."""
    lengths = np.array([3, 5, 2, 7, 4, 4])
    per_window = sft.sample_tokens(lengths, np.array([0, 2, 3, 4, 6]))
    assert per_window.tolist() == [8, 2, 7, 8]
    assert sft.sample_tokens(lengths, None).tolist() == lengths.tolist()
    sampler = MicroBatchSampler(len(per_window), micro_batch_size=1, grad_accum=2, dp_rank=0, dp_size=1, seed=3)
    micro_batches = list(itertools.islice(iter(sampler), 10))  # 5 steps of 2 micro-batches: 2.5 epochs
    drawn = [
        sum(int(per_window[key % len(per_window)]) for key in micro_batches[i] + micro_batches[i + 1])
        for i in range(0, 10, 2)
    ]
    assert sft.engine_step_tokens(per_window, 5, global_batch=2, seed=3) == drawn


@pytest.mark.parametrize(
    ("engine", "trl", "verdict"),
    [
        ([2.0], [2.1], None),
        ([2.00, 2.04, 2.02], [2.05, 2.01, 2.03], True),
        ([2.00, 2.01, 2.02], [2.10, 2.11, 2.12], False),
    ],
)
def test_sft_loss_goal_is_judged_against_the_spread_over_seeds(engine, trl, verdict) -> None:
    assert sft.within_seed_noise(engine, trl) is verdict


def test_trl_is_given_the_engines_recipe(sft_base: Path, tmp_path: Path) -> None:
    """bench/trl_sft.py's SFTConfig for the benchmark's launch: TRL's own checks accept it, and it
    holds the engine's batch, sequence length, packing, loss, optimizer, clipping and seed; what it
    cannot follow is refused, naming each setting."""
    from trl import SFTConfig

    sets = [*sft.recipe(sft_base), f"trainer.output_dir={tmp_path}"]
    document = load_config(sft.CONFIG, sets, world_size=1, hardware=detect_hardware(local_world_size=1)).document
    args = SFTConfig(**trl_sft.sft_arguments(document))
    params, data_section = document["optimizer"]["params"], document["data"]
    assert (args.learning_rate, args.adam_beta1, args.adam_beta2, args.adam_epsilon, args.weight_decay) == (
        params["lr"],
        *params["betas"],
        params["eps"],
        params["weight_decay"],
    )
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_steps, args.seed) == (
        document["train_micro_batch_size_per_gpu"],
        document["gradient_accumulation_steps"],
        document["trainer"]["max_steps"],
        document["trainer"]["seed"],
    )
    assert (args.max_length, args.packing, args.max_grad_norm) == (
        data_section["seq_len"],
        data_section["packing"],
        document["gradient_clipping"],
    )
    assert args.assistant_only_loss and args.lr_scheduler_type == "constant" and args.warmup_steps == 0
    assert not (args.bf16 or args.fp16 or args.activation_checkpointing)
    with pytest.raises(ValueError, match=r"scheduler: .*; bf16, fp16, torch_autocast: fp32 only"):
        trl_sft.sft_arguments({**document, "scheduler": {"type": "WarmupLR"}, "bf16": {"enabled": True}})


def test_trl_template_trains_what_the_engine_trains(sft_base: Path) -> None:
    """Over the whole chat sample: TRL's assistant mask under GENERATION_CHATML (its
    `{% generation %}` blocks, read by transformers' apply_chat_template as TRL reads them) equals the
    engine's loss mask under the base's own template, on the same ids, and both render the same text."""
    from transformers import AutoTokenizer

    records = trl_sft.training_records(CHAT_SAMPLE, validation_fraction=0.0)
    tokenizer = AutoTokenizer.from_pretrained(sft_base)
    trl_sft.check_same_text(tokenizer, trl_sft.GENERATION_CHATML, records)
    conversations = [(record["messages"], f"record {number}") for number, record in enumerate(records, start=1)]
    engine = chat_format(str(sft_base), None, "assistant").tokenize(conversations)
    for (ids, mask), record in zip(engine, records, strict=True):
        theirs = tokenizer.apply_chat_template(
            record["messages"],
            chat_template=trl_sft.GENERATION_CHATML,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert theirs["input_ids"] == ids.tolist()
        assert theirs["assistant_masks"] == mask.tolist()
