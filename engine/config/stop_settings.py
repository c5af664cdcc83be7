"""What trainer.signals and trainer.max_wall_time mean: signal names and durations, read the way
schedulers write them (SLURM's --time, its --signal names), parsed once into `StopSettings`."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from engine.config.sections import TrainerSection
from engine.launch.signals import named_signal

_DURATION_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(text: str) -> float:
    """Seconds in "HH:MM:SS", "MM:SS", "D-HH:MM:SS" (SLURM's --time), or "1h30m", "90m", "45s", "2d"."""
    text = text.strip()
    clock = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if clock and ":" in text:
        days, *parts = clock.groups()
        numbers = [int(part) for part in parts if part is not None]
        while len(numbers) < 3:
            numbers.insert(0, 0)
        hours, minutes, seconds = numbers
        return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    units = re.findall(r"(\d+(?:\.\d+)?)\s*([dhms])", text)
    if not units or re.sub(r"\d+(?:\.\d+)?\s*[dhms]", "", text).strip():
        raise ValueError(f'{text!r} is not a duration; write "HH:MM:SS", "D-HH:MM:SS" or e.g. "1h30m"')
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in units)


def signal_number(name: str) -> int:
    """The number of signal `name` ("SIGTERM" or "TERM"); ValueError for one that cannot be caught."""
    number = named_signal(name)
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{number.name} cannot be caught, so it cannot ask for a save")
    return int(number)


@dataclass(frozen=True)
class StopSettings:
    """What stops a run early with a save: the signals caught (numbers; none where
    trainer.save_on_signal is off), the grace a signal leaves, and the wall-clock limit in seconds."""

    signals: tuple[int, ...]
    grace_s: float
    wall_time_s: float | None

    @classmethod
    def from_trainer(cls, trainer: TrainerSection) -> StopSettings:
        """The trainer section's settings, parsed (the config's rules have refused what does not parse)."""
        signals = tuple(signal_number(name) for name in trainer.signals) if trainer.save_on_signal else ()
        limit = None if trainer.max_wall_time is None else parse_duration(trainer.max_wall_time)
        return cls(signals, trainer.signal_grace_s, limit)

    @property
    def asked(self) -> bool:
        return bool(self.signals) or self.wall_time_s is not None
