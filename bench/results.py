"""What a benchmark reports: rows of baseline, engine, ratio and goal, plus the series to plot.

Everything is plain data so results can be stored as JSON and a later run of one benchmark can
rewrite the report without re-running the others."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class Unavailable(Exception):
    """This machine cannot run the benchmark (no GPU): reported and passed over, not a failure."""


@dataclass(frozen=True)
class Goal:
    """A bound on the row's ratio (engine / baseline) or on the engine's own value."""

    subject: str  # "ratio" or "engine"
    bound: str  # ">=" or "<="
    limit: float

    def met(self, ratio: float, engine: float) -> bool:
        value = ratio if self.subject == "ratio" else engine
        return value >= self.limit if self.bound == ">=" else value <= self.limit

    def __str__(self) -> str:
        return f"{self.subject} {self.bound} {self.limit:g}"


@dataclass(frozen=True)
class Row:
    quantity: str
    baseline: float
    engine: float
    ratio: float  # engine / baseline
    goal: str
    met: bool | None  # None: no goal, or the goal is not judged by this run (`note` says why)
    note: str = ""


def compare(
    quantity: str,
    baseline: float,
    engine: float,
    goal: Goal | None = None,
    ratio: float | None = None,
    not_judged: str | None = None,
) -> Row:
    """A row with its ratio (engine / baseline unless a paired `ratio` is given) and its verdict:
    None without a goal, or when `not_judged` says why this run cannot judge it."""
    ratio = engine / baseline if ratio is None else ratio
    met = None if goal is None or not_judged else goal.met(ratio, engine)
    return Row(quantity, baseline, engine, ratio, str(goal) if goal else "", met, not_judged or "")


@dataclass(frozen=True)
class Panel:
    """One plot: named series of (x, y) points and an optional horizontal goal line."""

    title: str
    xlabel: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]]
    goal_line: float | None = None


@dataclass
class Result:
    name: str
    title: str
    baseline: str  # what the baseline is, in a phrase
    method: str  # how it was measured, in a sentence or two
    rows: list[Row]
    panels: list[Panel]
    machine: dict[str, Any] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # parts that ran and failed: part -> error

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        return cls(
            **{
                **data,
                "rows": [Row(**row) for row in data["rows"]],
                "panels": [
                    Panel(**{**panel, "series": {k: tuple(v) for k, v in panel["series"].items()}})
                    for panel in data["panels"]
                ],
            }
        )

    def summary(self) -> str:
        """The rows as terminal lines: each ratio next to its goal."""
        lines = [f"{self.name}: {self.title}"]
        for row in self.rows:
            line = f"  {row.quantity}: {self.baseline} {row.baseline:.4g}, engine {row.engine:.4g}"
            line += f", ratio {row.ratio:.3f}"
            if row.goal:
                verdict = {True: "met", False: "NOT met", None: f"not judged: {row.note}"}[row.met]
                line += f", goal {row.goal}: {verdict}"
            lines.append(line)
        lines.extend(f"  {part}: FAILED, no figures: {error.splitlines()[-1]}" for part, error in self.failures.items())
        return "\n".join(lines)
