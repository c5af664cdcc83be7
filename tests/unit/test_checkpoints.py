"""Checkpoint publication and resume targets, in-process on directories made by hand: a save is
published only when every rank has written, `latest` always names a complete checkpoint, older ones
are pruned, and an unfinished save or an earlier run's checkpoints are refused. The launched runs,
killed mid-training or mid-save and resumed, are in tests/launched/test_checkpoints_launched.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.checkpoints.store import LATEST, PARTIAL, latest_tag, prune, publish, resume_target


def make_tag(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    (root / tag / "weights.pt").write_text(tag)


def test_publish_renames_the_staging_directory_then_replaces_latest(tmp_path: Path):
    make_tag(tmp_path, "step00000002" + PARTIAL)
    publish(tmp_path, "step00000002" + PARTIAL, "step00000002")
    make_tag(tmp_path, "step00000004" + PARTIAL)
    assert latest_tag(tmp_path) == "step00000002"  # an unfinished save is invisible to a resume
    publish(tmp_path, "step00000004" + PARTIAL, "step00000004")
    assert latest_tag(tmp_path) == "step00000004"
    assert not (tmp_path / ("step00000004" + PARTIAL)).exists()
    assert not (tmp_path / (LATEST + PARTIAL)).exists()


def test_resaving_the_step_latest_names_keeps_a_complete_checkpoint_named_throughout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A resume from step 2 while `latest` names step 4 saves step 4 again: a crash as the new copy
    takes the old one's name must leave `latest` naming a checkpoint that is there, whole."""
    for tag in ("step00000002", "step00000004", "step00000004" + PARTIAL):
        make_tag(tmp_path, tag)
    (tmp_path / LATEST).write_text("step00000004")
    real_replace = os.replace

    def crash_on_the_staging_rename(source: Path, target: Path) -> None:
        if Path(source).name == "step00000004" + PARTIAL:
            raise OSError("killed")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", crash_on_the_staging_rename)
    with pytest.raises(OSError, match="killed"):
        publish(tmp_path, "step00000004" + PARTIAL, "step00000004")
    assert latest_tag(tmp_path) == "step00000002"
    assert (tmp_path / "step00000002" / "weights.pt").read_text() == "step00000002"

    monkeypatch.setattr(os, "replace", real_replace)
    (tmp_path / ("step00000004" + PARTIAL) / "weights.pt").write_text("new")
    publish(tmp_path, "step00000004" + PARTIAL, "step00000004")
    assert latest_tag(tmp_path) == "step00000004"
    assert (tmp_path / "step00000004" / "weights.pt").read_text() == "new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step00000002", "step00000004"]


def test_a_rewound_run_sets_the_later_checkpoints_of_the_run_it_left_aside(tmp_path: Path):
    """Resumed from step 2 of a run that reached step 6, the run saves step 3: steps 4 and 6 belong to
    the history it left. Pruning would have kept them as the newest and deleted steps 2 and 3."""
    for step in (2, 4, 6):
        make_tag(tmp_path, f"step{step:08d}")
    (tmp_path / LATEST).write_text("step00000006")
    make_tag(tmp_path, "step00000003" + PARTIAL)
    publish(tmp_path, "step00000003" + PARTIAL, "step00000003")
    assert latest_tag(tmp_path) == "step00000003"
    assert prune(tmp_path, keep_last=2) == []
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_dir()) == [
        "step00000002",
        "step00000003",
        "step00000004.abandoned",
        "step00000006.abandoned",
    ]
    (tmp_path / LATEST).unlink()
    assert latest_tag(tmp_path) == "step00000003"  # the fallback, too, finds this run's newest


def test_prune_keeps_the_newest_and_never_the_one_latest_names(tmp_path: Path):
    for step in (2, 4, 6, 8):
        make_tag(tmp_path, f"step{step:08d}")
    (tmp_path / LATEST).write_text("step00000002")  # a resume from step 2 re-saving its way up
    assert prune(tmp_path, keep_last=2) == ["step00000004"]
    assert sorted(path.name for path in tmp_path.iterdir() if path.is_dir()) == [
        "step00000002",
        "step00000006",
        "step00000008",
    ]
    assert prune(tmp_path, keep_last=0) == []


def test_an_unfinished_save_is_refused_as_a_resume_target(tmp_path: Path):
    make_tag(tmp_path, "step00000004" + PARTIAL)
    with pytest.raises(FileNotFoundError, match="is an unfinished save"):
        resume_target(str(tmp_path / ("step00000004" + PARTIAL)), tmp_path)


def test_a_resume_target_is_a_checkpoint_its_root_or_its_run(tmp_path: Path):
    root = tmp_path / "run" / "checkpoints"
    make_tag(root, "step00000004")
    (root / "step00000004" / "layout.json").write_text("{}")
    (root / LATEST).write_text("step00000004")
    for given in (root / "step00000004", root, tmp_path / "run"):
        assert resume_target(str(given), tmp_path) == (root, "step00000004")
    (tmp_path / "logs").mkdir()
    with pytest.raises(FileNotFoundError, match="logs is not a checkpoint; give a checkpoint directory"):
        resume_target(str(tmp_path / "logs"), tmp_path)


def test_a_fresh_start_refuses_an_output_dir_holding_an_earlier_runs_checkpoints(tmp_path: Path):
    """Its `latest` would name the earlier run until this one's first save, and pruning would keep
    the earlier run's higher steps over this run's."""
    assert resume_target(False, tmp_path) is None
    make_tag(tmp_path / "checkpoints", "step00000004")
    (tmp_path / "checkpoints" / LATEST).write_text("step00000004")
    with pytest.raises(FileExistsError, match=r"holds an earlier run's checkpoints \(latest: step00000004\)"):
        resume_target(False, tmp_path)


def test_without_latest_the_newest_published_checkpoint_is_the_latest(tmp_path: Path):
    """`latest` is only a pointer: every stepNNNNNNNN folder is complete, since saves are published by
    rename. Should the folder it names (or `latest` itself) be lost, a resume falls back to the newest
    one there, and a fresh start still refuses the directory."""
    root = tmp_path / "checkpoints"
    for tag in ("step00000002", "step00000004", "step00000006" + PARTIAL):
        make_tag(root, tag)
    (root / LATEST).write_text("step00000008")
    assert latest_tag(root) == "step00000004"
    assert resume_target(True, tmp_path) == (root, "step00000004")
    (root / LATEST).unlink()
    assert resume_target(str(tmp_path), tmp_path / "elsewhere") == (root, "step00000004")
    with pytest.raises(FileExistsError, match=r"latest: step00000004"):
        resume_target(False, tmp_path)
