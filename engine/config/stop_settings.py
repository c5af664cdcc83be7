"""What trainer.signals and trainer.max_wall_time mean: signal names and durations, read the way
schedulers write them (SLURM's --time, its --signal names)."""

from __future__ import annotations

import re
import signal

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
    spelled = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
    try:
        number = signal.Signals[spelled]
    except KeyError:
        raise ValueError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)") from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{spelled} cannot be caught, so it cannot ask for a save")
    return int(number)
