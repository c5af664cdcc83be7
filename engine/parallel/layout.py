"""Where every rank sits in the DP x PP x TP grid, and the table printed at start-up.

The grid is DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model, the last
varying fastest): the ranks of a tensor-parallel group are adjacent, so on a GPU node they share
the fastest links, and each pipeline stage is a contiguous block of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from engine.config import EngineConfig


@dataclass(frozen=True)
class Coordinates:
    stage: int
    data: int
    tensor: int


@dataclass(frozen=True)
class ParallelLayout:
    data: int
    pipeline: int
    tensor: int

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.tensor

    @property
    def model_parallel(self) -> bool:
        return self.pipeline > 1 or self.tensor > 1

    def topology(self) -> PipeModelDataParallelTopology:
        return PipeModelDataParallelTopology(num_pp=self.pipeline, num_mp=self.tensor, num_dp=self.data)

    def coordinates(self, rank: int) -> Coordinates:
        coord = self.topology().get_coord(rank)
        return Coordinates(stage=coord.pipe, data=coord.data, tensor=coord.model)

    def describe(self, stage_layers: list[str] | None = None) -> str:
        """One line per rank: its stage (and that stage's layers when known), tensor shard and
        data-parallel replica."""
        lines = [
            f"rank layout: {self.pipeline} pipeline stage(s) x {self.data} data-parallel replica(s) x "
            f"{self.tensor} tensor shard(s)"
        ]
        for rank in range(self.world_size):
            where = self.coordinates(rank)
            layers = f" ({stage_layers[where.stage]})" if stage_layers else ""
            lines.append(
                f"  rank {rank}: stage {where.stage + 1}/{self.pipeline}{layers}, "
                f"tensor shard {where.tensor + 1}/{self.tensor}, data replica {where.data + 1}/{self.data}"
            )
        return "\n".join(lines)


def parallel_layout(config: EngineConfig) -> ParallelLayout:
    parallel = config.parallel
    return ParallelLayout(
        data=config.dp_size, pipeline=parallel.pipeline_parallel_size, tensor=parallel.tensor_parallel_size
    )
