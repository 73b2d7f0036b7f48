"""What each worker of a rank gets: its coordinates, layers, CPUs and threads, device. No torch.

Pure functions of the flags and the machine, so tests (and the flag walk) can see what a command line would
start without starting it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lbd.engine.config.layout import ParallelLayout, parse_partition, split_layers
from lbd.engine.config.placement import format_cpus, rank_cpus, rank_threads, split_cpus
from lbd.engine.config.slices import ParallelConfig


@dataclass(frozen=True, slots=True)
class WorkerPlan:
    world_rank: int
    pp_rank: int
    tp_rank: int
    layers: tuple[int, int]  # [start, end) of its pipeline stage
    cpus: tuple[int, ...]  # CPU affinity (used on the CPU)
    threads: int  # torch / OpenMP threads (on the CPU)
    device_index: int  # index in the rank's CUDA_VISIBLE_DEVICES (on CUDA)

    @property
    def cpu_list(self) -> str:
        return format_cpus(list(self.cpus))


def layout_of(parallel: ParallelConfig) -> ParallelLayout:
    return ParallelLayout(tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size)


def plan_workers(parallel: ParallelConfig, num_layers: int,
                 env: dict[str, str] | None = None) -> list[WorkerPlan]:
    """One plan per worker, in world-rank order: the rank's CPUs split into contiguous slices (one CPU each,
    round robin, when there are fewer CPUs than workers), its threads divided evenly (at least one each)."""
    layout = layout_of(parallel)
    world = layout.world_size
    stages = split_layers(num_layers, layout.pp_size, parse_partition(parallel.pp_layer_partition))
    slices = split_cpus(rank_cpus(env), world)
    local, size = parallel.data_parallel_size_local, parallel.data_parallel_size
    threads = max(1, rank_threads(local, size, env) // world)
    plans = []
    for rank in range(world):
        _, pp, tp = layout.coords(rank)
        plans.append(WorkerPlan(rank, pp, tp, stages[pp], tuple(slices[rank]), threads,
                                layout.local_index(pp, tp)))
    return plans
