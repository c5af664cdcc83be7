"""ZeRO-Infinity's checks before launch, on the CPU: each nvme_path a folder this user can write, with
room for the swap files and a file system that takes direct I/O; the swap buffers within `ulimit -l`;
offload_param.buffer_size within the largest partition DeepSpeed swaps; a checkpoint resumed only the
way its optimizer states were saved; the masters an export reads back from the checkpoint's swap
files; and libaio named where DeepSpeed's async_io op cannot be built. What DeepSpeed does with each
is in engine/launch/nvme.py and engine/checkpoints/nvme.py; the launched runs are
tests/launched/test_nvme_offload.py."""

from __future__ import annotations

import copy
import errno
import os
import re
import resource
import shutil
from pathlib import Path

import pytest
import torch

from engine.checkpoints.nvme import OFFLOADED, _with_swapped_masters, resume_problem
from engine.checkpoints.store import CheckpointRef, step_tag
from engine.config import EngineConfig
from engine.describe import check_nvme_resume
from engine.launch import nvme
from engine.launch.nvme import nvme_problems
from engine.launch.ops import op_problems
from engine.plan import format_bytes
from engine.preflight import check_nvme
from tests.unit.test_config import CPU
from tests.unit.test_deepspeed_spellings import load, tiny_gpt
from tests.unit.test_nvme_config import ZERO3_NVME

PARAM, OPTIMIZER = "zero_optimization.offload_param.nvme_path", "zero_optimization.offload_optimizer.nvme_path"
MIB = 2**20


def swapping(param_path: Path | None, optimizer_path: Path | None = None) -> dict:
    """The two offload sections of a resolved document, as `nvme_problems` reads them."""
    sections = {}
    for section, path in (("offload_param", param_path), ("offload_optimizer", optimizer_path)):
        sections[section] = {"device": "nvme", "nvme_path": str(path)} if path else {"device": "none"}
    return {"zero_optimization": sections}


def nvme_config(
    directory: Path, n_embd: int = 32, buffer_size: int = 2_000_000, swap: Path | None = None, **sections: dict
) -> EngineConfig:
    """The tiny GPT at two ranks under ZeRO-3 with parameters and optimizer states swapped to `swap`
    (`directory`/swap unless given), in fp32 unless `sections` says otherwise."""
    zero = copy.deepcopy(ZERO3_NVME)
    for section in ("offload_param", "offload_optimizer"):
        zero[section]["nvme_path"] = str(swap or directory / "swap")
    zero["offload_param"]["buffer_size"] = buffer_size
    document = tiny_gpt(zero_optimization=zero, **sections)
    # The vocabulary `describe_run` settles from the tokenizer before it checks the folders.
    document["model"] = {**document["model"], "n_embd": n_embd, "vocab_size": 256}
    return load(directory, document, world_size=2, hardware=CPU)


@pytest.fixture
def may_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node whose ranks may page-lock their swap buffers (CAP_IPC_LOCK, as root in most containers):
    the buffer checks below are then the only ones that can refuse, whatever this machine's `ulimit -l`."""
    monkeypatch.setattr(nvme, "_may_lock_without_limit", lambda: True)


# --- each nvme_path on this node ---------------------------------------------------------------------


def test_a_path_under_a_regular_file_is_refused_naming_the_key_the_path_and_the_file(tmp_path: Path):
    file = tmp_path / "swap"
    file.write_text("not a folder")
    path = file / "params"
    expected = f"{PARAM} '{path}': {file} is not a folder; choose a folder on a local drive"
    assert nvme_problems(swapping(path), {str(path): MIB}, 0) == [expected]


def test_a_drive_without_room_for_the_swap_files_is_refused_with_both_sizes(tmp_path: Path):
    """The bytes are what `python -m engine plan` counts this node's ranks writing there; more than
    the drive has free, DeepSpeed would fail mid-run on its first write past the end."""
    needed = shutil.disk_usage(tmp_path).free + 2**40
    [problem] = nvme_problems(swapping(None, tmp_path), {str(tmp_path): needed}, 0)
    pattern = (
        rf"{re.escape(OPTIMIZER)} '{re.escape(str(tmp_path))}': the drive has [\d.]+ [KMGT]iB free and this "
        rf"node's ranks swap {re.escape(format_bytes(needed))} there \(python -m engine plan counts it\); "
        "free space or choose a larger drive"
    )
    assert re.fullmatch(pattern, problem), problem


def test_a_stopped_runs_swap_files_count_as_room(tmp_path: Path):
    """DeepSpeed replaces the swap files under `zero_stage_3/` when the next run starts: a restart on a
    drive the last run filled must not be refused for the space its own files take."""
    left = tmp_path / "zero_stage_3" / "optimizer" / "rank0" / "6_10.tensor.swp"
    left.parent.mkdir(parents=True)
    left.write_bytes(bytes(64 * 2**20))
    needed = shutil.disk_usage(tmp_path).free + 32 * 2**20  # half of it: other writers may take some
    assert nvme_problems(swapping(None, tmp_path), {str(tmp_path): needed}, 0) == []


def test_a_file_system_refusing_direct_io_is_refused_and_the_probe_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """DeepSpeed's async_io opens every swap file with O_DIRECT; a file system that refuses it (a
    network or FUSE mount, an older tmpfs) answers EINVAL, as this `open` does."""
    real_open = os.open

    def refusing_direct_io(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(nvme.os, "open", refusing_direct_io)
    assert nvme_problems(swapping(tmp_path), {str(tmp_path): MIB}, 0) == [
        f"{PARAM} '{tmp_path}': its file system refuses direct I/O (Invalid argument), which DeepSpeed's async_io "
        "swaps with; use a folder on a local drive (ext4, xfs)"
    ]
    assert list(tmp_path.iterdir()) == []


def test_swap_buffers_above_ulimit_l_are_refused_without_cap_ipc_lock(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """DeepSpeed's page-locked buffers come from an `mlock` that returns no buffer past RLIMIT_MEMLOCK;
    a process with CAP_IPC_LOCK is not held to that limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 * 2**10, hard))  # the kernel's default, 64 KiB
    try:
        monkeypatch.setattr(nvme, "_may_lock_without_limit", lambda: False)
        assert nvme_problems(swapping(tmp_path), {str(tmp_path): MIB}, 512 * MIB) == [
            "each rank page-locks 512.00 MiB of swap buffers for NVMe offload and `ulimit -l` allows 64.00 KiB: "
            "raise it (ulimit -l unlimited; memlock in /etc/security/limits.conf, or the container's "
            "--ulimit memlock=-1), or lower offload_param.buffer_count/buffer_size, offload_optimizer.buffer_count "
            "or zero_optimization.sub_group_size"
        ]
        monkeypatch.setattr(nvme, "_may_lock_without_limit", lambda: True)
        assert nvme_problems(swapping(tmp_path), {str(tmp_path): MIB}, 512 * MIB) == []
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_a_writable_local_folder_within_the_limits_gives_no_problem(tmp_path: Path):
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    locked = 2**30 if soft == resource.RLIM_INFINITY else soft  # as much as this user may lock
    path = tmp_path / "not" / "made" / "yet"  # DeepSpeed's swappers make the folders below an existing one
    assert nvme_problems(swapping(path, tmp_path), {str(path): MIB, str(tmp_path): MIB}, locked) == []
    assert not (tmp_path / "not").exists()


def test_parameters_and_optimizer_states_sharing_a_path_are_one_message_naming_both_keys(tmp_path: Path):
    """The configs write one drive for both, as DeepSpeed's examples do; it is one folder to fix."""
    file = tmp_path / "swap"
    file.write_text("not a folder")
    path = file / "swap"
    config = nvme_config(tmp_path, swap=path)
    assert nvme_problems(config.document, {str(path): MIB}, 0) == [
        f"{PARAM} and {OPTIMIZER} '{path}': {file} is not a folder; choose a folder on a local drive"
    ]


# --- offload_param.buffer_size against the model -----------------------------------------------------
# At n_embd 384 the largest tensor is an MLP matrix, 384 x 1536, 294912 elements a rank at two: 1.125 MiB
# in fp32, above DeepSpeed's smallest swap (1 MiB), so swapped through one buffer of buffer_size elements.


def test_a_buffer_size_below_the_largest_swapped_partition_is_refused_with_both_numbers(tmp_path: Path, may_lock: None):
    """DeepSpeed asserts it only when it first swaps that partition in, inside the first forward."""
    config = nvme_config(tmp_path, n_embd=384, buffer_size=100_000)
    with pytest.raises(ValueError) as refused:
        check_nvme(config, CPU)
    assert str(refused.value) == (
        "NVMe offload: zero_optimization.offload_param.buffer_size: 100000 elements is less than this model's "
        "largest parameter partition, 294912, which DeepSpeed swaps through one buffer: raise it to at least 294912"
    )


@pytest.mark.parametrize("buffer_size", [294_912, 2_000_000])
def test_a_buffer_size_at_or_above_the_largest_partition_passes(tmp_path: Path, may_lock: None, buffer_size: int):
    check_nvme(nvme_config(tmp_path, n_embd=384, buffer_size=buffer_size), CPU)


@pytest.mark.parametrize(
    "n_embd, sections",
    [
        (32, {}),  # every partition a few KiB
        (384, {"bf16": {"enabled": True}}),  # the 294912-element partition is 576 KiB in bf16
    ],
    ids=["tiny_fp32", "bf16"],
)
def test_partitions_under_the_smallest_swap_stay_in_memory_and_no_buffer_size_is_too_small(
    tmp_path: Path, may_lock: None, n_embd: int, sections: dict
):
    """DeepSpeed keeps a partition under max(1 MiB, aio.block_size) of its own dtype in host memory, and
    never puts it through a swap buffer."""
    config = nvme_config(tmp_path, n_embd=n_embd, buffer_size=1000, **sections)
    assert config.precision == ("bf16" if sections else "fp32")
    check_nvme(config, CPU)


# --- resuming a checkpoint ---------------------------------------------------------------------------


def saved_checkpoint(directory: Path, swapped: bool) -> Path:
    tag_dir = directory / step_tag(10)
    (tag_dir / OFFLOADED / "rank00" if swapped else tag_dir).mkdir(parents=True)
    return tag_dir


AS_SAVED = (
    "DeepSpeed loads them only the way they were saved: set zero_optimization.offload_optimizer.device as the "
    "saving run had it"
)


@pytest.mark.parametrize(
    "saved_swapped, swaps, reshape, problem",
    [
        (True, True, False, None),
        (False, False, False, None),
        (False, False, True, None),
        (True, False, False, f"keeps its optimizer states on NVMe and this run does not swap them; {AS_SAVED}"),
        (
            False,
            True,
            False,
            f"keeps its optimizer states in its optimizer files and this run swaps them to NVMe; {AS_SAVED}",
        ),
        (
            True,
            True,
            True,
            "keeps its optimizer states in NVMe swap files, which DeepSpeed's universal conversion (a resume on "
            "another layout) cannot read; resume it on the layout that saved it",
        ),
    ],
    ids=["both_swap", "neither_swaps", "neither_swaps_reshaped", "saved_swapped", "run_swaps", "reshaped"],
)
def test_a_checkpoint_resumes_only_as_its_optimizer_states_were_saved(
    tmp_path: Path, saved_swapped: bool, swaps: bool, reshape: bool, problem: str | None
):
    """A run that swaps finds no swap files to read where the checkpoint has none, and one that does not
    swap reads the empty tensors DeepSpeed saves for every swapped sub-group."""
    expected = problem and f"checkpoint step00000010 {problem}"
    assert resume_problem(saved_checkpoint(tmp_path, saved_swapped), swaps, reshape) == expected


def test_prepare_refuses_resuming_swapped_states_without_nvme_naming_trainer_resume(tmp_path: Path):
    config = nvme_config(tmp_path)
    saved_checkpoint(tmp_path, swapped=False)
    with pytest.raises(ValueError, match=r"^trainer\.resume: checkpoint step00000010 keeps its optimizer states in"):
        check_nvme_resume(config, CheckpointRef(tmp_path, step_tag(10)), reshape=False)


# --- the masters an export reads back ----------------------------------------------------------------


def write_swap_file(path: Path, values: torch.Tensor) -> None:
    """A swap file as DeepSpeed writes it: the fp32 values, padded to its 1 KiB I/O alignment (here
    with -1s, which no master holds)."""
    padded = torch.full((-(-values.numel() // 256) * 256,), -1.0)
    padded[: values.numel()] = values
    padded.numpy().tofile(path)


def test_empty_sub_groups_are_replaced_in_order_by_their_swap_files_first_elements(tmp_path: Path):
    """Files are named by the sub-group's first and last parameter id: `12_12` follows `6_10` though it
    sorts before it as text. The Adam moments beside them are no masters."""
    first, second = torch.arange(5.0) + 0.5, torch.arange(4.0) + 100.0
    write_swap_file(tmp_path / "6_10.tensor.swp", first)
    write_swap_file(tmp_path / "12_12.tensor.swp", second)
    write_swap_file(tmp_path / "exp_avg-6_10.tensor.swp", torch.full((5,), 7.0))
    write_swap_file(tmp_path / "exp_avg_sq-12_12.tensor.swp", torch.full((4,), 9.0))
    kept = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 5.0])]  # under DeepSpeed's smallest swap
    groups = [kept[0], torch.empty(0), kept[1], torch.empty(0)]
    joined = _with_swapped_masters(groups, [3, 5, 2, 4], tmp_path)
    for got, expected in zip(joined, [kept[0], first, kept[1], second], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_missing_swap_file_is_refused_naming_the_folder(tmp_path: Path):
    write_swap_file(tmp_path / "6_10.tensor.swp", torch.arange(5.0))
    write_swap_file(tmp_path / "exp_avg-12_12.tensor.swp", torch.arange(4.0))  # its master is gone
    groups = [torch.tensor([1.0, 2.0, 3.0]), torch.empty(0), torch.tensor([4.0, 5.0]), torch.empty(0)]
    with pytest.raises(ValueError) as refused:
        _with_swapped_masters(groups, [3, 5, 2, 4], tmp_path)
    assert str(refused.value) == (
        f"{tmp_path}: 1 swapped masters for 2 empty sub-groups of 4; the checkpoint is incomplete"
    )


# --- the async_io op ---------------------------------------------------------------------------------


def test_async_io_without_libaio_names_the_package_and_the_config_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """DeepSpeed's AsyncIOBuilder finds no libaio headers (its `is_compatible`, which compiles a probe
    against libaio.h): the build would fail inside `deepspeed.initialize` on every rank. A compiler and
    ninja are on PATH, so DeepSpeed's own check is the only cause."""
    from deepspeed.accelerator import get_accelerator

    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("c++", "ninja"):
        (tools / tool).write_text("#!/bin/sh\n")
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    monkeypatch.setattr(type(builder), "is_compatible", lambda self, verbose=False: False)
    assert op_problems(["async_io"], []) == [
        "DeepSpeed op async_io cannot be built on this node: DeepSpeed's AsyncIOBuilder reports it cannot be built "
        "here. Fix: install libaio with its headers (apt-get install libaio-dev, dnf install libaio-devel); or set "
        'zero_optimization.offload_*.device to "cpu" and drop checkpoint.writer (NVMe offload and FastPersist '
        "write through async_io)"
    ]
