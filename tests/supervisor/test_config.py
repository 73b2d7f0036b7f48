"""Rank launch specs from DP flags: ports, ranks, device slices, engine flags passed through unchanged."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lbd.engine.config.args import make_parser
from lbd.supervisor.config import parse_args, visible_cuda_devices
from lbd.supervisor.rank_types import Backoff
from support import free_port_run


def _cfg(*extra: str, env: dict[str, str] | None = None):
    base = free_port_run(5)  # up to 4 ranks, then the health port
    args = ["--host", "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
            "--data-parallel-supervisor-port", str(base + 4), *extra]
    return base, parse_args(args, env=env or {})


def _engine_ns(argv: list[str]):
    assert argv[:3] == [sys.executable, "-m", "lbd.engine"]
    return make_parser().parse_args(argv[3:])


def test_ranks_get_ports_ranks_and_passthrough_flags() -> None:
    base, cfg = _cfg("--data-parallel-size", "4", "--data-parallel-size-local", "2", "--node-rank", "1",
                     "--device", "cpu", "--max-num-seqs", "4", "--no-enable-prefix-caching",
                     "--served-model-name", "a", "b", "--kv-cache-memory-bytes", "1GiB", "--enforce-eager",
                     "--distributed-timeout-s", "30", "--shutdown-timeout", "7.5", "--chat-template",
                     "-{{ odd }}")
    assert [r.rank for r in cfg.ranks] == [2, 3] and cfg.dp_start_rank == 2
    assert [r.port for r in cfg.ranks] == [base, base + 1]
    for i, spec in enumerate(cfg.ranks):
        ns = _engine_ns(spec.argv)
        assert (ns.port, ns.data_parallel_rank, ns.data_parallel_size) == (base + i, 2 + i, 4)
        assert ns.data_parallel_size_local == 2 and ns.data_parallel_start_rank is None
        assert ns.host == "127.0.0.1" and ns.device == "cpu" and ns.max_num_seqs == 4
        assert ns.enable_prefix_caching is False and ns.enforce_eager is True
        assert ns.served_model_name == ["a", "b"] and ns.kv_cache_memory_bytes == 1 << 30
        assert ns.distributed_timeout_s == 30
        assert ns.shutdown_timeout == 7.5 and ns.chat_template == "-{{ odd }}"
        assert spec.devices is None and "CUDA_VISIBLE_DEVICES" not in spec.env
        assert spec.env["LBD_RANK_CPUS"] == spec.cpus
        assert spec.probe_url == f"http://127.0.0.1:{base + i}"
    assert cfg.shutdown_timeout_s == 7.5 and cfg.drain_timeout_s == 7.5


def test_defaults_pass_nothing_extra() -> None:
    _, cfg = _cfg("--data-parallel-size", "1", "--device", "cpu")
    (spec,) = cfg.ranks
    assert spec.argv[3:] == ["--device=cpu", "--host=127.0.0.1", "--port", str(spec.port),
                             "--data-parallel-rank", "0", "--data-parallel-size", "1",
                             "--data-parallel-size-local", "1"]
    assert cfg.ready_needed == 1 and cfg.on_rank_failure == "restart-rank"
    assert (cfg.probe_interval_s, cfg.probe_timeout_s, cfg.probe_failure_threshold) == (5.0, 5.0, 3)
    assert cfg.hang_detection_bound_s == 20.0


def test_single_rank_node_of_a_larger_group() -> None:
    """Unlike vLLM, L = 1 is fine: node 3 of a 4-rank group runs rank 3 alone."""
    _, cfg = _cfg("--data-parallel-size", "4", "--data-parallel-size-local", "1", "--node-rank", "3",
                  "--device", "cpu")
    assert [r.rank for r in cfg.ranks] == [3]


def test_cuda_device_slices(tiny_llama: Path) -> None:
    _, cfg = _cfg("--model", str(tiny_llama), "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                  env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [r.devices for r in cfg.ranks] == ["4,5", "6,7"]
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in cfg.ranks] == ["4,5", "6,7"]
    assert all(r.cpus is None and "LBD_RANK_CPUS" not in r.env for r in cfg.ranks)
    _, cfg = _cfg("--model", str(tiny_llama), "--data-parallel-size", "2", "--pipeline-parallel-size", "2",
                  "--data-parallel-size-local", "1", "--node-rank", "1",
                  env={"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b, GPU-c"})
    assert [r.devices for r in cfg.ranks] == ["GPU-a,GPU-b"]


def test_cpu_slices_split_the_cores_between_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    _, cfg = _cfg("--data-parallel-size", "3", "--device", "cpu")
    assert [r.env["LBD_RANK_CPUS"] for r in cfg.ranks] == ["0-2", "3-5", "6-7"]
    _, cfg = _cfg("--data-parallel-size", "4", "--device", "cpu")
    assert [r.cpus for r in cfg.ranks] == ["0-1", "2-3", "4-5", "6-7"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    _, cfg = _cfg("--data-parallel-size", "3", "--device", "cpu")
    assert [r.cpus for r in cfg.ranks] == ["0", "1", "0"]  # more ranks than CPUs: round robin


def test_visible_devices_rules() -> None:
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, "cpu") is None
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, "sim") is None
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, "auto") == ["0", "1"]
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": ""}, "auto") is None  # no GPUs: the CPU
    assert visible_cuda_devices({"CUDA_VISIBLE_DEVICES": ""}, "cuda") == []


@pytest.mark.parametrize(("policy", "needed"), [("all", 3), ("any", 1), ("2", 2)])
def test_ready_policy(policy: str, needed: int) -> None:
    _, cfg = _cfg("--data-parallel-size", "3", "--device", "cpu", "--ready-policy", policy)
    assert cfg.ready_needed == needed


def test_admin_token_from_env() -> None:
    _, cfg = _cfg("--device", "cpu", env={"LBD_ADMIN_TOKEN": "s3cret"})
    assert cfg.admin_token == "s3cret"
    _, cfg = _cfg("--device", "cpu", "--admin-token", "flag", env={"LBD_ADMIN_TOKEN": "s3cret"})
    assert cfg.admin_token == "flag"
    _, cfg = _cfg("--device", "cpu")
    assert cfg.admin_token is None


def test_backoff_doubles_caps_and_resets() -> None:
    b = Backoff(initial=1.0, maximum=60.0, reset_after=300.0)
    assert [b.next_delay(0.0) for _ in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert b.next_delay(299.0) == 60
    assert b.next_delay(300.0) == 1  # healthy for 5 minutes: start over
    assert b.next_delay(10.0) == 2
