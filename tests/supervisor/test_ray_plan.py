"""Where `--data-parallel-backend ray` puts each rank (vLLM's pack strategies), without a Ray cluster, and
that nothing but that backend imports ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lbd.supervisor.ray_rank import PlacementError, RayNode, plan_ranks

HERE, B, C = RayNode("h", "10.0.0.1", 4.0), RayNode("b", "10.0.0.2", 8.0), RayNode("c", "10.0.0.3", 2.0)


def _ips(plan: list[RayNode]) -> list[str]:
    return [n.ip[-1] for n in plan]


def test_strict_puts_exactly_the_local_count_on_each_node_used() -> None:
    # 2 ranks of 2 devices per node; C (2 devices) cannot hold 2 ranks and is skipped
    assert _ips(plan_ranks([HERE, C, B], 4, 2, 2, "strict", "GPU")) == ["1", "1", "2", "2"]
    assert _ips(plan_ranks([HERE], 2, 2, 1, "strict", "CPU")) == ["1", "1"]


def test_fill_takes_what_fits_beyond_this_node() -> None:
    # this node takes --data-parallel-size-local (1), B as many as its 8 devices hold (4)
    assert _ips(plan_ranks([HERE, B], 5, 1, 2, "fill", "GPU")) == ["1", "2", "2", "2", "2"]
    with pytest.raises(PlacementError, match="room for 5 of --data-parallel-size 6"):
        plan_ranks([HERE, B], 6, 1, 2, "fill", "GPU")


def test_not_enough_room_is_a_clear_error() -> None:
    with pytest.raises(PlacementError, match="this Ray node .* has 4 GPU but --data-parallel-size-local 3"):
        plan_ranks([HERE, B], 4, 3, 2, "strict", "GPU")
    with pytest.raises(PlacementError, match="room for 4 of --data-parallel-size 6 ranks"):
        plan_ranks([HERE, C, B], 6, 2, 2, "strict", "GPU")


def test_router_and_supervisor_never_import_ray() -> None:
    code = ("import sys, lbd.serve.cli, lbd.router.cli, lbd.supervisor.cli, lbd.supervisor.node; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
