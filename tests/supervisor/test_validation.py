"""`lbd supervise` refuses bad command lines before starting anything: exit 2, one line naming the flag."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from lbd.common.ports import port_in_use
from support import free_port_run

TOPOLOGY = ["--data-parallel-multi-port-external-lb", "--device", "cpu"]


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "lbd", "supervise", *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def _assert_refused(proc: subprocess.CompletedProcess[str], *needles: str, ports: list[int]) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("lbd supervise: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "[rank" not in proc.stdout + proc.stderr  # no rank was started
    for port in ports:
        assert port_in_use("127.0.0.1", port) is None, f"port {port} left bound"


def _base_args(base: int, sport: int, size: int = 2, local: int | None = 2) -> list[str]:
    args = [*TOPOLOGY, "--host", "127.0.0.1", "--port", str(base), "--data-parallel-size", str(size),
            "--supervisor-host", "127.0.0.1", "--data-parallel-supervisor-port", str(sport)]
    return args + (["--data-parallel-size-local", str(local)] if local is not None else [])


@pytest.fixture
def ports() -> tuple[int, int]:
    base = free_port_run(8)
    return base, base + 6


@pytest.mark.parametrize(("extra", "needles"), [
    (["--data-parallel-size", "2", "--data-parallel-size-local", "4"], ["--data-parallel-size-local 4"]),
    (["--data-parallel-size", "3", "--data-parallel-size-local", "2"],
     ["--data-parallel-size 3", "divisible"]),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "3"],
     ["--data-parallel-start-rank 3"]),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--node-rank", "2"],
     ["--node-rank 2", "4..5"]),
    (["--data-parallel-size", "2", "--no-such-engine-flag", "1"], ["'--no-such-engine-flag'"]),
    (["--data-parallel-size", "2", "--block-size", "3"], ["--block-size"]),
    (["--data-parallel-size", "2", "--data-parallel-rank", "1"], ["--data-parallel-rank", "drop it"]),
    (["--data-parallel-size", "2", "--ready-policy", "3"], ["--ready-policy 3"]),
    (["--data-parallel-size", "2", "--ready-policy", "most"], ["--ready-policy"]),
    (["--data-parallel-size", "2", "--dp-supervisor-probe-interval-s", "0"],
     ["--dp-supervisor-probe-interval-s"]),
    (["--data-parallel-size", "2", "--dp-supervisor-probe-failure-threshold", "0"],
     ["--dp-supervisor-probe-failure-threshold"]),
    (["--data-parallel-size", "2", "--on-rank-failure", "ignore"], ["--on-rank-failure"]),
])
def test_bad_topology_and_flags(ports: tuple[int, int], extra: list[str], needles: list[str]) -> None:
    base, sport = ports
    proc = _run([*TOPOLOGY, "--host", "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
                 "--data-parallel-supervisor-port", str(sport), *extra])
    _assert_refused(proc, *needles, ports=[base, base + 1, sport])


def test_supervisor_port_inside_rank_ports(ports: tuple[int, int]) -> None:
    base, _ = ports
    proc = _run(_base_args(base, base + 1))
    _assert_refused(proc, "--data-parallel-supervisor-port", str(base + 1), ports=[base, base + 1])


def test_rank_port_in_use(ports: tuple[int, int]) -> None:
    base, sport = ports
    with socket.socket() as held:
        held.bind(("127.0.0.1", base + 1))
        held.listen()
        proc = _run(_base_args(base, sport))
        _assert_refused(proc, "--port", str(base + 1), "in use", ports=[base, sport])


def test_supervisor_port_in_use(ports: tuple[int, int]) -> None:
    base, sport = ports
    with socket.socket() as held:
        held.bind(("127.0.0.1", sport))
        held.listen()
        t0 = time.monotonic()
        proc = _run(_base_args(base, sport))
        _assert_refused(proc, "--data-parallel-supervisor-port", str(sport), ports=[base, base + 1])
        assert time.monotonic() - t0 < 10


def test_rank_ports_past_65535() -> None:
    proc = _run([*TOPOLOGY, "--port", "65535", "--data-parallel-size", "2"])
    _assert_refused(proc, "--port 65535", ports=[])


@pytest.mark.parametrize(("visible", "extra", "needles"), [
    ("0", ["--data-parallel-size", "2"], ["needs 2 CUDA devices", "1 are visible"]),
    ("0,1,2", ["--data-parallel-size", "2", "--tensor-parallel-size", "3"],
     ["--tensor-parallel-size 3", "needs 6 CUDA devices"]),
    ("", ["--data-parallel-size", "1", "--device", "cuda"], ["needs 1 CUDA devices", "0 are visible"]),
])
def test_too_few_cuda_devices(ports: tuple[int, int], visible: str, extra: list[str],
                              needles: list[str]) -> None:
    base, sport = ports
    args = ["--host", "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
            "--data-parallel-supervisor-port", str(sport), *extra]
    proc = _run(args, env={"CUDA_VISIBLE_DEVICES": visible})
    _assert_refused(proc, "--data-parallel-size-local", *needles, ports=[base, base + 1, sport])


def test_help_lists_engine_and_supervisor_flags() -> None:
    proc = _run(["--help"])
    assert proc.returncode == 0
    for flag in ("--dp-supervisor-probe-interval-s", "--ready-policy", "--on-rank-failure", "--max-num-seqs",
                 "--data-parallel-supervisor-port", "--admin-token"):
        assert flag in proc.stdout
