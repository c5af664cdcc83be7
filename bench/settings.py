"""The knobs of one `python -m bench` invocation, shared by every benchmark."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    rounds: int  # paired trials (fresh processes) per speed benchmark
    steps: int  # optimizer steps per speed trial; timed by log window, the first one (start-up) excluded
    log_interval: int  # steps per timed window (one logged step in each)
    quality_steps: int  # benchmark 3's training length (its goal is stated at 2000)
    quality_rounds: int  # benchmark 3's paired trials
    threads: int  # CPU threads of every side
