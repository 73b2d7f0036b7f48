"""Readiness answers and /status fields from rank states, without starting any rank."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from aiohttp.test_utils import make_mocked_request

from lbd.common.redact import redact_argv
from lbd.supervisor import rank as rank_module
from lbd.supervisor.config import parse_args
from lbd.supervisor.health import HealthServer
from lbd.supervisor.node import Supervisor
from lbd.wire.states import RankState
from lbd.wire.status import ProbeSettings
from support import free_port_run


def _supervisor(*extra: str) -> Supervisor:
    base = free_port_run(5)  # up to 4 ranks, then the health port
    return Supervisor(parse_args(["--port", str(base), "--data-parallel-supervisor-port", str(base + 4),
                                  "--device", "cpu", "--data-parallel-size", "2", *extra], env={}))


@pytest.mark.parametrize(("policy", "ready_with_one"), [("all", False), ("any", True), ("1", True),
                                                         ("2", False)])
def test_readiness_follows_the_policy(policy: str, ready_with_one: bool) -> None:
    sup = _supervisor("--ready-policy", policy)
    ok, reason = sup.readiness()
    assert not ok and "rank 0 starting; rank 1 starting" in reason
    sup.workers[0].state = RankState.READY
    sup.workers[1].state = RankState.DRAINING
    ok, reason = sup.readiness()
    assert ok is ready_with_one, reason
    assert reason.startswith(f"1/2 ranks ready (policy {policy}")
    sup.workers[1].state = RankState.READY
    assert sup.readiness() == (True, f"2/2 ranks ready (policy {policy})")
    sup.phase = "stopping"
    assert sup.readiness() == (False, "supervisor is stopping")
    assert sup.liveness()[0]


def test_status_lists_every_rank_with_its_url() -> None:
    sup = _supervisor("--host", "127.0.0.1", "--data-parallel-size-local", "2")
    status = sup.status("127.0.0.1")
    assert [r.rank for r in status.ranks] == [0, 1]
    first = status.ranks[0]
    assert first.url == f"http://127.0.0.1:{first.port}" and first.state is RankState.STARTING
    assert first.routable is False and first.restarts == 0 and first.pid is None
    assert status.ready is False and status.ready_ranks == 0
    assert status.probe == ProbeSettings(interval_s=5.0, timeout_s=5.0, failure_threshold=3, generate_every=0)


@pytest.mark.parametrize(("bind", "host_header", "expected"), [
    (None, "node-a:9256", "node-a"), (None, "10.1.2.3:9256", "10.1.2.3"),
    (None, "[fd00::5]:9256", "[fd00::5]"), (None, "node-b", "node-b"),
    ("127.0.0.1", "node-a:9256", "127.0.0.1"),
])
def test_rank_url_host(bind: str | None, host_header: str, expected: str) -> None:
    sup = _supervisor(*(["--host", bind] if bind else []))
    server = HealthServer(sup)
    request = make_mocked_request("GET", "/status", headers={"Host": host_header})
    assert server._url_host(request) == expected


def test_status_command_is_redacted_once_and_follows_an_argv_rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
    """/status reads every rank's masked command line on every call: it is redacted once per argv, yet a new
    argv (a Ray placement rewrites it) shows at once, and a caller editing the list it got changes nothing."""
    calls: list[int] = []

    def counted(argv: Sequence[str]) -> list[str]:  # the real redaction, counted
        calls.append(1)
        return redact_argv(argv)

    monkeypatch.setattr(rank_module, "redact_argv", counted)
    sup = _supervisor()
    worker = sup.workers[0]
    worker.spec.argv = [*worker.spec.argv, "--api-key", "sk-not-shown"]  # pragma: allowlist secret
    first = sup.status("127.0.0.1").ranks[0].command
    assert first[-2:] == ["--api-key", "***"]
    for _ in range(3):
        assert sup.status("127.0.0.1").ranks[0].command == first
    assert len(calls) == len(sup.workers)  # once per rank, not once per call
    first.append("--edited")
    assert "--edited" not in worker.command()
    worker.spec.argv = [*worker.spec.argv, "--token=tk-new"]  # pragma: allowlist secret
    assert worker.command()[-1] == "--token=***"
    worker.spec.argv.append("--extra")  # edited in place, too
    assert worker.command()[-1] == "--extra"
