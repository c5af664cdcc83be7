"""Where every rank sits in the DP x PP x TP grid, or the DP x SP grid, and the table printed at
start-up.

The model-parallel grid is DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data, model, the
last varying fastest): the ranks of a tensor-parallel group are adjacent, so on a GPU node they share
the fastest links, and each pipeline stage is a contiguous block of ranks. Sequence parallelism
(Ulysses) runs beside data parallelism alone, in DeepSpeed's own groups
(`deepspeed.runtime.sequence_parallel.parallel_state_sp`): the ranks of a sequence-parallel group
are adjacent too, rank = data replica x SP + sequence shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig

if TYPE_CHECKING:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class Coordinates:
    stage: int
    data: int
    tensor: int
    sequence: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    data: int
    pipeline: int
    tensor: int
    sequence: int = 1  # parallel.sequence_parallel_size: ranks that split each sequence (Ulysses)

    @property
    def world_size(self) -> int:
        return self.data * self.pipeline * self.tensor * self.sequence

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions model states over: every data replica's sequence shards, which
        hold the same weights (DeepSpeed's sequence-data-parallel group)."""
        return self.data * self.sequence

    @property
    def model_parallel(self) -> bool:
        return self.pipeline > 1 or self.tensor > 1

    def topology(self) -> PipeModelDataParallelTopology:
        # Imported here: `validate` builds a layout, and DeepSpeed takes seconds to import.
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pipeline, num_mp=self.tensor, num_dp=self.data)

    def coordinates(self, rank: int) -> Coordinates:
        if self.sequence > 1:
            return Coordinates(stage=0, data=rank // self.sequence, tensor=0, sequence=rank % self.sequence)
        coord = self.topology().get_coord(rank)
        return Coordinates(stage=coord.pipe, data=coord.data, tensor=coord.model)

    def describe(self, stage_layers: list[str] | None = None) -> str:
        """One line per rank: its stage (and that stage's layers when known), tensor shard and
        data-parallel replica; under sequence parallelism its replica and sequence shard."""
        if self.sequence > 1:
            lines = [f"rank layout: {self.data} data-parallel replica(s) x {self.sequence} sequence shard(s)"]
            for rank in range(self.world_size):
                where = self.coordinates(rank)
                lines.append(
                    f"  rank {rank}: data replica {where.data + 1}/{self.data}, sequence shard "
                    f"{where.sequence + 1}/{self.sequence}"
                )
            return "\n".join(lines)
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
        data=config.dp_size,
        pipeline=parallel.pipeline_parallel_size,
        tensor=parallel.tensor_parallel_size,
        sequence=parallel.sequence_parallel_size,
    )
