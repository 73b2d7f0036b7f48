"""Rank arithmetic of a (DP x) PP x TP group and the pipeline's split of layers into stages. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """``world_rank = dp * (pp_size * tp_size) + pp * tp_size + tp`` (see ``lbd.engine.distributed``)."""

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0

    @property
    def ranks_per_dp(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def world_size(self) -> int:
        return self.dp_size * self.ranks_per_dp

    def world_rank(self, pp: int, tp: int, dp: int | None = None) -> int:
        dp = self.dp_rank if dp is None else dp
        return dp * self.ranks_per_dp + pp * self.tp_size + tp

    def coords(self, world_rank: int) -> tuple[int, int, int]:
        """(dp, pp, tp) of ``world_rank``."""
        dp, rest = divmod(world_rank, self.ranks_per_dp)
        pp, tp = divmod(rest, self.tp_size)
        return dp, pp, tp

    def local_index(self, pp: int, tp: int) -> int:
        """Index of a worker inside its DP rank (its device index in the rank's CUDA_VISIBLE_DEVICES)."""
        return pp * self.tp_size + tp

    def tp_group(self, pp: int, dp: int | None = None) -> list[int]:
        return [self.world_rank(pp, t, dp) for t in range(self.tp_size)]

    def pp_group(self, tp: int, dp: int | None = None) -> list[int]:
        return [self.world_rank(p, tp, dp) for p in range(self.pp_size)]

    def all_tp_groups(self) -> list[list[int]]:
        """Every TP group of the world, in a fixed order (group creation is collective: all ranks call it
        for every group, in the same order)."""
        return [self.tp_group(p, d) for d in range(self.dp_size) for p in range(self.pp_size)]


def parse_partition(text: str | None) -> list[int] | None:
    """``"10,10,12"`` -> [10, 10, 12]; raises ValueError on anything else (the flag check words it)."""
    if text is None or not text.strip():
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"expected comma-separated layer counts like 10,10,12, got {text!r}")
    return [int(p) for p in parts]


def split_layers(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage. Even split by default; a remainder goes to the stages before the last, as
    vLLM does (the last one also runs the LM head). ``partition`` (validated: pp_size positive counts summing
    to num_layers) overrides it."""
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base] * pp_size
        for i in range(extra):
            partition[-2 - i] += 1
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + count))
        start += count
    return bounds
