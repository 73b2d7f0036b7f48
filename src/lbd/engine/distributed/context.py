"""What one model shard needs to know: where it sits in the layout, which layers it holds, its collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from lbd.engine.config.layout import ParallelLayout, split_layers

if TYPE_CHECKING:
    from lbd.engine.distributed.groups import ProcessGroups


@dataclass(slots=True)
class ParallelContext:
    layout: ParallelLayout
    pp_rank: int = 0
    tp_rank: int = 0
    partition: list[int] | None = None  # --pp-layer-partition (validated), None = even split
    groups: ProcessGroups | None = None  # None on a single device

    @classmethod
    def single(cls) -> ParallelContext:
        return cls(ParallelLayout())

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def world_rank(self) -> int:
        return self.layout.world_rank(self.pp_rank, self.tp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_sampler(self) -> bool:
        """The one worker that samples and returns tokens: TP rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the layers this stage holds."""
        return split_layers(num_layers, self.pp_size, self.partition)[self.pp_rank]
