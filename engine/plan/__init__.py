"""The planner: what each rank holds, predicted on the meta device before a run.

`plan_run` gives per-rank parameter, gradient and optimizer-state bytes equal to what
`engine.observability.memory.rank_memory` measures on that rank, plus estimated activations and communication,
and the data's memory from the sizes `data_sizes` reads off the datasets; `report` prints them,
tells them rank by rank and searches the layouts that fit. `nvme_bytes` is what each NVMe folder
receives from a node under ZeRO-Infinity, for the checks before a launch.
"""

from engine.observability.units import format_bytes
from engine.plan.data import DataSizes, data_sizes
from engine.plan.planner import Plan, RankPlan, nvme_bytes, parse_bytes, plan_run
from engine.plan.report import explain, suggest, table, verdict

__all__ = [
    "DataSizes",
    "Plan",
    "RankPlan",
    "data_sizes",
    "explain",
    "format_bytes",
    "nvme_bytes",
    "parse_bytes",
    "plan_run",
    "suggest",
    "table",
    "verdict",
]
