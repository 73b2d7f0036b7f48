"""`lbd route` flag validation: one line naming the flag, exit 2, nothing bound; the router stays light."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from support import free_port

LBD = [sys.executable, "-m", "lbd", "route"]


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ([], "--upstreams"),
        (["--upstreams", "localhost:8000"], "--upstreams"),
        (["--upstreams", "ftp://h:1"], "--upstreams"),
        (["--upstreams", "http://h:99999"], "--upstreams"),
        (["--upstreams", "http://h:1/v1"], "--upstreams"),
        (["--upstreams-file", "/nonexistent/file"], "--upstreams-file"),
        (["--upstreams", "http://h:1", "--workers", "0"], "--workers"),
        (["--upstreams", "http://h:1", "--scrape-interval-ms", "0"], "--scrape-interval-ms"),
        (["--upstreams", "http://h:1", "--port", "70000"], "--port"),
        (["--upstreams", "http://h:1", "--policy", "nope"], "--policy"),
        (["--upstreams", "http://h:1", "--max-retries", "-1"], "--max-retries"),
        (["--upstreams", "http://h:1", "--migration-limit", "-1"], "--migration-limit"),
        (["--upstreams", "http://h:1", "--bogus"], "--bogus"),
        (["--upstreams", "http://h:1", "--kv-events", "maybe"], "--kv-events"),
        (["--upstreams", "http://h:1", "--evict-weight", "-1"], "--evict-weight"),
        (["--upstreams", "http://h:1", "--autoscale-target-utilization", "0"],
         "--autoscale-target-utilization"),
        (["--upstreams", "http://h:1", "--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--upstreams", "http://h:1", "--kv-events", "off", "--forward-prompt-ids"], "--forward-prompt-ids"),
        (["--upstreams", "http://h:1", "--forward-prompt-ids"], "LBD_INTERNAL_KEY"),  # nothing to sign with
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], flag: str) -> None:
    r = subprocess.run([*LBD, *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert flag in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_port_in_use_exits_2_naming_the_port() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        r = subprocess.run(
            [*LBD, "--upstreams", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 2 and f"--port {port}" in r.stderr


def test_help_lists_every_policy_and_defaults() -> None:
    out = subprocess.run([*LBD, "--help"], capture_output=True, text=True, timeout=30).stdout
    for name in (
        "predicted_ttft",
        "least_load",
        "prefix_affinity",
        "session",
        "kv_aware",
        "p2c",
        "round_robin",
    ):
        assert name in out
    assert "default: predicted_ttft" in out and "--scrape-interval-ms" in out


def test_router_imports_nothing_heavy_and_starts_fast() -> None:
    # nothing of the engine package, only the stdlib-only lbd.common (shared limits, keys, TLS)
    code = (
        "import sys, time; t = time.process_time(); import lbd.router.cli, lbd.router.app; "
        "heavy = any(m in sys.modules for m in ('torch', 'transformers', 'aiohttp')) or any("
        "m.startswith('lbd.engine') for m in sys.modules); print(time.process_time() - t, heavy)"
    )
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert out[1] == "False"
    # CPU seconds of the imports (~0.15 here), not wall time: a machine shared with other tests stretches that
    assert float(out[0]) < 1.0 and time.monotonic() - t0 < 30.0


def test_workers_default_to_one_per_usable_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workers`` defaults to auto (the suite sets LBD_ROUTE_WORKERS=1 to keep its routers light; a user
    without it gets auto); auto counts usable CPUs up to the cap, and a running router has that many."""
    from lbd.common.cpus import usable_cpus
    from lbd.router.flags import AUTO_WORKERS_MAX, WORKERS_ENV, make_parser

    auto = min(AUTO_WORKERS_MAX, usable_cpus())
    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert make_parser().parse_args(["--upstreams", "http://h:1"]).workers == auto
    assert make_parser().parse_args(["--upstreams", "http://h:1", "--workers", "AUTO"]).workers == auto
    monkeypatch.setenv(WORKERS_ENV, "3")
    assert make_parser().parse_args(["--upstreams", "http://h:1"]).workers == 3
    psutil = pytest.importorskip("psutil")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != WORKERS_ENV}
    proc = subprocess.Popen([*LBD, "--upstreams", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port",
                             str(port), "--log-level", "warning"], env=env)
    try:
        deadline = time.monotonic() + 30
        seen = -1
        while time.monotonic() < deadline:
            kids = psutil.Process(proc.pid).children()
            seen = len(kids) if auto > 1 else 1  # one worker runs in the launcher's own process
            with socket.socket() as s:
                if seen == auto and s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        assert seen == auto, (seen, auto)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
