"""Flow control by tenant and priority (lbd.router.flow) through a real `lbd route` over a fleet stand-in
rank (tests/support/fleet_standin.py), real HTTP.

Saturation is made two ways: by load, with ``--flow-max-prefill-tokens-per-rank 1`` (a rank is full while
one of the router's requests there has not answered: the stand-in answers whole, at the end, so the rank
serves one request at a time and every other waits in the router, ordered by flow control); and on demand,
by the stand-in's control port making the rank report 99 waiting requests (``--flow-max-waiting-per-rank``
4): then nothing is released until the test clears it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from lbd.common import scaling
from lbd.common.auth import read_key_file
from lbd.common.scaling import AutoscaleReport
from support import RouterServer, metric_value
from support.procs import free_port_run, spawn, stop, wait_http

STANDIN = Path(__file__).resolve().parents[1] / "support" / "fleet_standin.py"
TENANT = "x-gateway-inference-fairness-id"
PROMPT = "hello world " * 20
ONE_AT_A_TIME = ("--flow-max-prefill-tokens-per-rank", "1", "--kv-events", "off")


class Fleet:
    """Two stand-in ranks: most tests route to rank 0 alone (``url``), the placement test to both."""

    def __init__(self, tmp: Path) -> None:
        self.base = free_port_run(3)
        self.proc = spawn([sys.executable, str(STANDIN), "--ranks", "2", "--base-port", str(self.base),
                           "--control-port", str(self.base + 2)], log=tmp / "fleet.log")
        self.urls = [f"http://127.0.0.1:{self.base + i}" for i in range(2)]
        for u in self.urls:
            wait_http(u + "/health", 30, self.proc)
        self.url = self.urls[0]

    def waiting(self, n: int | None, rank: int = 0) -> None:
        """The rank reports ``n`` waiting requests (None: its own numbers again)."""
        body = {} if n is None else {"waiting": n}
        httpx.post(f"http://127.0.0.1:{self.base + 2}/standin/{rank}/set", json=body,
                   timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("flow"))
    try:
        yield f
    finally:
        stop(f.proc)


@pytest.fixture(scope="module")
def router(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterServer]:
    """Flow control on (by default it engages once two flows are seen; these tests see many), one worker."""
    r = RouterServer("--upstreams", fleet.url, "--workers", "1", *ONE_AT_A_TIME, "--flow-max-queued", "40",
                     "--flow-max-queued-per-tenant", "14", "--flow-sheddable-priority", "5",
                     log=tmp_path_factory.mktemp("flow-router") / "router.log")
    try:
        r.wait_ready()
        assert _post(r.url, "first").status_code == 200 and not _flow(r)["engaged"]  # one flow: not yet
        assert _post(r.url, "second").status_code == 200 and _flow(r)["engaged"]
        yield r
    finally:
        r.close()


def _post(url: str, tenant: str | None = None, priority: int | None = None, timeout: float = 30,
          headers: dict[str, str] | None = None, key: str | None = None, client: httpx.Client | None = None,
          max_tokens: int = 8) -> httpx.Response:
    h = dict(headers or {})
    if tenant is not None:
        h[TENANT] = tenant
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    body: dict = {"model": "standin-model", "prompt": PROMPT, "max_tokens": max_tokens}
    if priority is not None:
        body["priority"] = priority
    post = client.post if client is not None else httpx.post
    return post(url + "/v1/completions", json=body, headers=h, timeout=timeout)


def _flow(r: RouterServer) -> dict:
    return r.status()["flow"]


def _send_raw(port: int, tenant: str, extra: bytes = b"", **fields: object) -> socket.socket:
    """A client that sent a completion request and reads nothing (the test closes it: a vanished client)."""
    body = json.dumps({"model": "standin-model", "prompt": PROMPT, "max_tokens": 8, **fields}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + extra
    sock.sendall(head + b"%s: %s\r\nContent-Length: %d\r\n\r\n%s" % (TENANT.encode(), tenant.encode(),
                                                                         len(body), body))
    return sock


def _wait_for(read, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not read():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _saturate(fleet: Fleet, r: RouterServer) -> None:
    fleet.waiting(99)
    _wait_for(lambda: _flow(r)["saturated"] == "waiting_requests", "the router never saw the rank saturated")


def _held(r: RouterServer) -> int:
    return sum(f["queued"] for f in _flow(r)["flows"])


def _closed_loops(url: str, loops: dict[str, int], count: int, keys: bool = False) -> dict[str, int]:
    """``loops[tenant]`` clients per tenant (an API key with ``keys``), each sending one request after
    another; returns how many of ``count`` answers each tenant got, counted from when every client has had its
    first answer (all are backlogged: the start is not counted) until ``count`` answers, then every client
    stops. A count, not a time window: on a loaded host the clients start late and unevenly, and a window of
    seconds then measures who started first, not the shares."""
    done = dict.fromkeys(loops, 0)
    lock = threading.Lock()
    clients = sum(loops.values())
    start = threading.Barrier(clients, timeout=60)
    warm: set[int] = set()
    enough = threading.Event()

    def loop(tenant: str, i: int) -> None:
        with httpx.Client() as client:  # (kept alive: the next request follows at once)
            start.wait()
            while not enough.is_set():
                resp = _post(url, client=client, max_tokens=16, **{"key" if keys else "tenant": tenant})
                assert resp.status_code == 200, resp.text
                with lock:
                    if len(warm) < clients:
                        warm.add(i)
                    elif sum(done.values()) < count:
                        done[tenant] += 1
                        if sum(done.values()) == count:
                            enough.set()

    with cf.ThreadPoolExecutor(clients) as pool:
        tenants = [t for t, n in loops.items() for _ in range(n)]
        futures = [pool.submit(loop, t, i) for i, t in enumerate(tenants)]
        for f in futures:
            f.result()
    return done


def test_the_key_file_carries_tenant_weight_and_max_priority(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("k1 name=a tenant=team-a weight=2 max_priority=1\nk2 tenant=team-a weight=2\nk3\n")
    a, b, c = read_key_file(path)
    assert (a.tenant, a.weight, a.max_priority) == ("team-a", 2.0, 1) and b.max_priority is None
    assert (c.tenant, c.weight) == (None, 1.0)
    path.write_text("k1 tenant=t weight=2\nk2 tenant=t weight=3\n")
    with pytest.raises(ValueError, match="one weight"):
        read_key_file(path)
    path.write_text("k1 tenant=bad name\n")
    with pytest.raises(ValueError):
        read_key_file(path)


def test_bands_dispatch_strictly(fleet: Fleet, router: RouterServer) -> None:
    """Held while the rank is full, then one at a time: every class -1 (vLLM's numbering: more urgent than
    0, not sheddable) before any class 0, then class 1, then class 2, whatever the arrival order."""
    _saturate(fleet, router)
    order: list[int] = []
    lock = threading.Lock()

    def send(p: int) -> None:
        assert _post(router.url, "bands", p).status_code == 200
        with lock:
            order.append(p)

    with cf.ThreadPoolExecutor(9) as pool:
        futures = []
        for p in (2, 2, 2, 0, 0, -1, 1, 1, -1):
            futures.append(pool.submit(send, p))
            time.sleep(0.02)
        _wait_for(lambda: _held(router) == 9, "nine requests held")
        fleet.waiting(None)
        for f in futures:
            f.result()
    assert order == [-1, -1, 0, 0, 1, 1, 2, 2, 2], order


def test_equal_weights_share_tokens_whatever_the_demand(fleet: Fleet, router: RouterServer) -> None:
    """Past saturation (one request at a time), a tenant with 2 clients and one with 8 (1x and 4x its fair
    share) are served near-equal tokens; without flow control the second gets ~4x (the last test).
    (3 and 12 clients, not 1 and 4: one is in service, the others keep the tenant waiting in the router.)"""
    fleet.waiting(None)
    done = _closed_loops(router.url, {"light": 3, "heavy": 12}, 24)
    assert 0.75 <= done["light"] / done["heavy"] <= 1.33, done
    wait = {f["tenant"]: f["wait_s_mean"] for f in _flow(router)["flows"]}
    assert wait["heavy"] > 2 * wait["light"], wait  # the heavy tenant's backlog was held in the router


def test_a_full_queue_is_429_and_a_vanished_client_leaves_it(fleet: Fleet, router: RouterServer) -> None:
    """--flow-max-queued-per-tenant 14: the 15th is answered 429 with Retry-After; held clients that go away
    leave the queue gauge (status and /metrics) at 0 at once."""
    _saturate(fleet, router)
    held = [_send_raw(router.port, "flood") for _ in range(14)]  # (raw: no client to build per request)
    _wait_for(lambda: _held(router) == 14, "fourteen requests held")
    with httpx.Client() as client:
        t0 = time.monotonic()
        over = _post(router.url, "flood", client=client)
        assert over.status_code == 429 and time.monotonic() - t0 < 1.0, over.text
    assert int(over.headers["retry-after"]) >= 1
    assert "--flow-max-queued-per-tenant" in over.json()["error"]["message"]
    for sock in held:  # the clients go away
        sock.close()
    _wait_for(lambda: _held(router) == 0, "the vanished clients' requests left the queue", 3.0)
    text = httpx.get(router.url + "/metrics", timeout=5).text
    assert metric_value(text, "lbd_router_flow_queued") == 0
    assert metric_value(text, "lbd_router_flow_shed_total", tenant="flood", reason="queue_full") == 1
    fleet.waiting(None)



def test_autoscale_signals_follow_saturation_and_the_held_backlog(fleet: Fleet, router: RouterServer) -> None:
    """Issue 46: /metrics' lbd_router_autoscale_* and /router/status's ``autoscale`` (one type, decoded
    with it). Idle: nothing queued, 1 rank recommended. Saturated (the rank reports 99 waiting): saturation
    1.0, and three requests held in the router add their prompts to the backlog (a new flow: the default
    prompt each); the recommendation is the rule's on the reported signals, at least 2."""
    fleet.waiting(None)
    _wait_for(lambda: router.status()["autoscale"]["signals"]["saturation"] == 0.0, "an idle fleet")
    idle = msgspec.convert(router.status()["autoscale"], AutoscaleReport)
    assert (idle.signals.ranks, idle.signals.token_backlog, idle.recommended_ranks) == (1, 0, 1), idle
    assert idle.signals.ttft_target_s == 2.0  # --ttft-target-ms's default
    _saturate(fleet, router)
    before = msgspec.convert(router.status()["autoscale"], AutoscaleReport)
    with cf.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_post, router.url, "autoscale") for _ in range(3)]
        _wait_for(lambda: _held(router) == 3, "three requests held")
        text = httpx.get(router.url + "/metrics", timeout=5).text
        held = msgspec.convert(router.status()["autoscale"], AutoscaleReport)
        fleet.waiting(None)
        for f in futures:
            assert f.result().status_code == 200
    assert before.signals.saturation == 1.0 and before.signals.token_backlog > 0, before
    assert held.signals.token_backlog - before.signals.token_backlog == 3 * scaling.TOKENS_PER_WAITING_REQUEST
    assert held.recommended_ranks == scaling.recommended_ranks(held.signals) >= 2, held
    assert metric_value(text, "lbd_router_autoscale_saturation") == 1.0
    assert metric_value(text, "lbd_router_autoscale_token_backlog") == held.signals.token_backlog
    assert metric_value(text, "lbd_router_autoscale_recommended_ranks") == held.recommended_ranks
    assert metric_value(text, "lbd_router_autoscale_ttft_target_seconds") == 2.0
    assert metric_value(text, "lbd_router_autoscale_predicted_ttft_seconds") > 0

def test_deadlines_and_sheddable_are_answered_early(fleet: Fleet, router: RouterServer) -> None:
    """Saturated: a sheddable class (--flow-sheddable-priority 5: 5 and higher numbers) is 503 at once, by
    the body's priority and by x-lbd-priority; a deadline is 503 by the deadline, naming it, and at once when
    the queue ahead has not moved for a while."""
    _saturate(fleet, router)
    for shed in (_post(router.url, "low", 5), _post(router.url, "low", headers={"x-lbd-priority": "7"})):
        assert shed.status_code == 503 and shed.headers["retry-after"] == "1", shed.text
        assert "--flow-sheddable-priority 5" in shed.json()["error"]["message"]
    assert metric_value(httpx.get(router.url + "/metrics", timeout=5).text, "lbd_router_flow_shed_total",
                        tenant="low", reason="sheddable") == 2
    with httpx.Client() as client, cf.ThreadPoolExecutor(1) as pool:
        try:
            t0 = time.monotonic()
            late = _post(router.url, "rush", headers={"x-lbd-ttft-deadline-ms": "400"}, client=client)
            took = time.monotonic() - t0
            assert late.status_code == 503, late.text
            assert "x-lbd-ttft-deadline-ms" in late.json()["error"]["message"], late.text
            assert 0.35 <= took < 3.0, took  # by its deadline (not --flow-max-wait-s, 60 s)
            # one held over a second, none released: the wait is unbounded, a deadline is refused at once
            stuck = pool.submit(_post, router.url, "stuck", None, 30)
            _wait_for(lambda: _held(router) == 1, "one request held")
            time.sleep(1.2)
            early = _post(router.url, "rush", headers={"x-lbd-ttft-deadline-ms": "5000"}, client=client)
            assert early.status_code == 503, early.text
            assert "cannot be met" in early.json()["error"]["message"]  # (at its deadline: "passed while")
        finally:
            fleet.waiting(None)
        assert stuck.result().status_code == 200
    bad = _post(router.url, "rush", headers={"x-lbd-ttft-deadline-ms": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-lbd-ttft-deadline-ms"
    assert _post(router.url, "rush", headers={"x-lbd-priority": "high"}).status_code == 400


def test_weights_from_the_key_file_across_two_workers(fleet: Fleet, tmp_path: Path) -> None:
    """Tenants of weight 1 and 2 (key file), both past their share, over two router workers that share the
    counters: served about 1:2; a key asking for a priority above its max_priority is refused 403; with
    --flow-engine-preemption a request is not held while a less important one runs."""
    fleet.waiting(None)
    keys = tmp_path / "keys"
    keys.write_text("k-one tenant=one\nk-two tenant=two weight=2\nk-capped tenant=one max_priority=1\n")
    r = RouterServer("--upstreams", fleet.url, "--workers", "2", *ONE_AT_A_TIME, "--api-key-file", str(keys),
                     "--flow-engine-preemption", log=tmp_path / "router.log").wait_ready()
    try:
        assert _post(r.url, key="k-capped", priority=0).status_code == 403
        done = _closed_loops(r.url, {"k-one": 4, "k-two": 4}, 21, keys=True)
        assert 1.5 <= done["k-two"] / done["k-one"] <= 2.7, done
        # --flow-engine-preemption: a class-2 request fills the rank, a class-0 one is not held behind it
        with cf.ThreadPoolExecutor(1) as pool:
            long = pool.submit(_post, r.url, priority=2, key="k-one", max_tokens=400)
            flows = lambda: r.status(headers={"Authorization": "Bearer k-one"})["flow"]["flows"]  # noqa: E731
            _wait_for(lambda: any(f["priority"] == 2 and f["dispatched"] for f in flows()), "class 2 sent")
            t0 = time.monotonic()
            assert _post(r.url, key="k-two").status_code == 200
            assert not long.done() and time.monotonic() - t0 < 1.0
            assert long.result().status_code == 200
    finally:
        r.close()


def test_off_passes_everything_straight_through(fleet: Fleet, tmp_path: Path) -> None:
    """--flow-control off: a saturated rank gets every request at once (none held, none shed), and the
    demand decides the shares (4 clients to 1: ~4x)."""
    r = RouterServer("--upstreams", fleet.url, "--workers", "1", *ONE_AT_A_TIME, "--flow-control", "off",
                     log=tmp_path / "router.log").wait_ready()
    try:
        fleet.waiting(99)
        time.sleep(0.3)  # the router has seen it (the stand-in pushes its load)
        t0 = time.monotonic()
        assert _post(r.url, "low", -1).status_code == 200 and time.monotonic() - t0 < 2.0
        assert r.status()["flow"] == {"mode": "off"}
        assert "lbd_router_flow_queued" not in httpx.get(r.url + "/metrics", timeout=5).text
        fleet.waiting(None)
        done = _closed_loops(r.url, {"light": 3, "heavy": 12}, 30)
        assert done["heavy"] / done["light"] >= 2.5, done
    finally:
        r.close()


def test_a_preempting_class_goes_where_its_peers_do_not_fill_the_seats(fleet: Fleet, tmp_path: Path) -> None:
    """--flow-engine-preemption, every rank saturated: a class-0 request is let through (its engine preempts
    a class-2 one), and goes to the rank with the fewest class-0 requests in flight, where a class-2 one holds
    a seat; the policy alone (blind to classes) sends them all to one rank (here the one holding the prompt's
    prefix). Every request is long (none ends during the test): the ranks' running counts say where each
    went. (The module's last test: its requests are cut when it ends.)"""
    r = RouterServer("--upstreams", ",".join(fleet.urls), "--workers", "1", "--flow-control", "on",
                     "--flow-engine-preemption", "--kv-events", "off", log=tmp_path / "router.log")
    held: list[socket.socket] = []
    try:
        r.wait_ready()
        # three long class-2 requests on rank 0 (pinned, before the ranks are saturated: let through)
        held = [_send_raw(r.port, "bulk", b"X-data-parallel-rank: 0\r\n", priority=2, max_tokens=4000)
                for _ in range(3)]
        _wait_for(lambda: sum(f["dispatched"] for f in _flow(r)["flows"] if f["tenant"] == "bulk") == 3,
                  "three class-2 requests sent")
        for i in range(2):
            fleet.waiting(99, i)
        _wait_for(lambda: _flow(r)["saturated"] == "waiting_requests", "both ranks saturated")
        for n in range(1, 5):  # one after another, each in flight when the next is decided
            held.append(_send_raw(r.port, "live", priority=0, max_tokens=4000))
            _wait_for(lambda n=n: sum(f["dispatched"] for f in _flow(r)["flows"]
                                      if f["tenant"] == "live") == n, "class 0 let through")
        running = lambda: [metric_value(httpx.get(u + "/metrics", timeout=5).text,  # noqa: E731
                                        "vllm:num_requests_running") for u in fleet.urls]
        _wait_for(lambda: sum(running()) == 7, "seven requests running")
        assert running() == [3 + 2, 2], running()  # (the policy alone: [3 + 4, 0])
    finally:
        for sock in held:
            sock.close()
        r.close()
        for i in range(2):
            fleet.waiting(None, i)
