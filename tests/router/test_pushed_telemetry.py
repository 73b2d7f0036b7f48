"""Pushed telemetry (lbd.router.load_feed), end to end: a real `lbd route` over ranks that publish their load.

- Over the fleet stand-in (tests/support/fleet_standin.py: three ranks in one process, scripted through its
  control port): after each step of a script (numbers change, a message is lost, a rank restarts) the
  router's view equals the scraped view (each rank's /telemetry); a rank that stops publishing is marked
  stale within two heartbeats and scraped (its numbers still reach the router), and is pushed again when it
  publishes again.
- A message counts for the endpoint whose stream it came on: a publisher that names another rank's
  instance, stream or DP rank changes nothing there (counted in lbd_router_telemetry_push_refused_total).
- Over a real `--device sim` engine: its stream is followed, the view matches /telemetry after a request,
  and a restart of the engine on the same port is followed to the new stream.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import RouterServer, metric_value
from support.procs import engine_server, free_port, free_port_run, spawn, stop, wait_http

HEARTBEAT_S = 0.4
STANDIN = Path(__file__).resolve().parents[1] / "support" / "fleet_standin.py"
FIELDS = (("running", "num_requests_running"), ("waiting", "num_requests_waiting"),
          ("kv_usage", "kv_cache_usage_perc"))


class Fleet:
    def __init__(self, tmp: Path, ranks: int, *extra: str, env: dict[str, str] | None = None) -> None:
        self.base = free_port_run(ranks + 1)  # the control port is the run's last: below the ephemeral range
        port = str(self.base + ranks)
        self.control = f"http://127.0.0.1:{port}"
        self.urls = [f"http://127.0.0.1:{self.base + i}" for i in range(ranks)]
        self.proc = spawn([sys.executable, str(STANDIN), "--ranks", str(ranks), "--base-port", str(self.base),
                           "--control-port", port, "--heartbeat-s", str(HEARTBEAT_S), *extra],
                          env=env, log=tmp / "fleet.log")
        for url in self.urls:
            wait_http(url + "/health", 30, self.proc)

    def act(self, rank: int, action: str, body: dict | None = None) -> None:
        httpx.post(f"{self.control}/standin/{rank}/{action}", json=body or {}, timeout=5).raise_for_status()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, RouterServer]]:
    tmp = tmp_path_factory.mktemp("pushed")
    f = Fleet(tmp, 3)
    router = RouterServer("--upstreams", ",".join(f.urls), "--policy", "least_load", log=tmp / "router.log")
    try:
        router.wait_ready()
        # every rank followed and heard from (a rank not adopted yet has no push record at all)
        _until(lambda: all(_push(router, u).get("state") == "pushed" for u in f.urls), 10)
        yield f, router
    finally:
        router.close()
        stop(f.proc)


def _push(router: RouterServer, url: str) -> dict:
    return _endpoint(router, url).get("telemetry_push") or {}


def _endpoint(router: RouterServer, url: str) -> dict:
    return next(e for e in router.status()["endpoints"] if e["url"] == url)


def _until(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def _views_match(router: RouterServer, urls: list[str]) -> bool:
    """The router's numbers for every rank equal what a scrape of its /telemetry reads now."""
    eps = {e["url"]: e for e in router.status()["endpoints"]}
    for url in urls:
        scraped = httpx.get(url + "/telemetry", timeout=5).json()
        if any(abs(float(eps[url][ours]) - float(scraped[theirs])) > 1e-9 for ours, theirs in FIELDS):
            return False
    return True


def test_router_view_equals_scraped_view_through_a_script(fleet: tuple[Fleet, RouterServer]) -> None:
    f, router = fleet
    script = [
        lambda: f.act(0, "set", {"running": 3, "waiting": 2, "kv_usage": 0.5}),
        lambda: (f.act(1, "skip"), f.act(1, "set", {"running": 7, "waiting": 1, "kv_usage": 0.25})),
        lambda: (f.act(2, "set", {"running": 4}), f.act(2, "restart"), f.act(2, "set", {"waiting": 5})),
        lambda: f.act(0, "set", {"running": 1, "waiting": 0, "kv_usage": 0.125}),
    ]
    for step in script:
        step()
        _until(lambda: _views_match(router, f.urls), 3 * HEARTBEAT_S + 2)
    # the gap is counted when the message after the skipped one arrives; the views can match before that
    # (a rank silent past two heartbeats is scraped), so wait for it rather than read it once
    _until(lambda: _push(router, f.urls[1])["gaps"] >= 1, 3 * HEARTBEAT_S + 2)
    pushes = [_push(router, u) for u in f.urls]
    assert pushes[2]["restarts"] >= 1, pushes[2]
    assert all(p["state"] == "pushed" for p in pushes), pushes
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert "lbd_router_telemetry_push_age_seconds" in metrics


def _refused(router: RouterServer, reason: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return metric_value(text, "lbd_router_telemetry_push_refused_total", reason=reason) or 0.0


def test_a_publisher_sets_its_own_load_only(fleet: tuple[Fleet, RouterServer]) -> None:
    """Messages count for the endpoint whose stream they came on: rank 1's publisher naming rank 0's
    instance, rank 0's stream (a fake restart) or DP rank 0 changes nothing of rank 0 and is counted."""
    f, router = fleet
    f.act(0, "set", {"running": 1, "waiting": 0, "kv_usage": 0.125})
    _until(lambda: _views_match(router, f.urls), 3 * HEARTBEAT_S + 2)
    restarts = _push(router, f.urls[0])["restarts"]
    for claim, reason in (({"as": 0}, "instance"), ({"as": 0, "instance": "f0f0f0f0"}, "stream"),
                          ({"as": 1, "rank": 0}, "rank")):
        before = _refused(router, reason)
        f.act(1, "forge", claim)
        _until(lambda reason=reason, before=before: _refused(router, reason) > before, 5)
    time.sleep(HEARTBEAT_S)
    ep0, ep1 = _endpoint(router, f.urls[0]), _endpoint(router, f.urls[1])
    assert ep0["running"] == 1 and ep1["running"] != 999 and ep1["rank"] == 1, (ep0, ep1)
    assert _push(router, f.urls[0])["restarts"] == restarts  # nothing it had cached was forgotten
    assert _views_match(router, f.urls)


def test_silent_rank_is_stale_within_two_heartbeats_and_scraped(fleet: tuple[Fleet, RouterServer]) -> None:
    f, router = fleet
    url = f.urls[0]
    before = _push(router, url)["stale_count"]
    f.act(0, "pause")
    try:
        _until(lambda: _push(router, url)["stale_count"] > before, 10)
        push = _push(router, url)
        assert push["state"] == "stale"
        assert push["stale_after_s"] <= 2 * HEARTBEAT_S, push  # the router's own measure of the silence
        # not published (paused): only a scrape can bring these to the router
        f.act(0, "set", {"running": 9, "waiting": 4, "kv_usage": 0.75})
        _until(lambda: _views_match(router, [url]), 5)
    finally:
        f.act(0, "resume")
        f.act(0, "set", {"running": 2})
    _until(lambda: _push(router, url)["state"] == "pushed", 3 * HEARTBEAT_S + 2)
    _until(lambda: _views_match(router, [url]), 3)


def test_sim_engine_publishes_and_a_restart_is_followed(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ("--device", "sim", "--max-model-len", "512", "--load-heartbeat-s", str(HEARTBEAT_S),
            "--log-level", "warning")

    def engine():
        return engine_server(tiny_llama, *args, log=tmp_path / "engine.log", port=port)

    with engine() as eng:
        router = RouterServer("--upstreams", eng.base_url, log=tmp_path / "router.log")
        try:
            router.wait_ready()
            _until(lambda: _push(router, eng.base_url).get("state") == "pushed", 15)
            first = _push(router, eng.base_url)["stream"]
            model = httpx.get(eng.base_url + "/v1/models", timeout=5).json()["data"][0]["id"]
            r = httpx.post(router.url + "/v1/completions", timeout=60,
                           json={"model": model, "prompt": "hello " * 40, "max_tokens": 8})
            assert r.status_code == 200, r.text
            _until(lambda: _views_match(router, [eng.base_url]), 5)
            eng.close()
            with engine():
                _until(lambda: (_push(router, eng.base_url).get("stream") not in (None, first)
                                and _push(router, eng.base_url)["state"] == "pushed"), 30)
                _until(lambda: _views_match(router, [eng.base_url]), 5)
        finally:
            router.close()


def test_a_fleet_beyond_the_sample_threshold_keeps_prefixes_together(tmp_path: Path) -> None:
    """80 ranks (over policies.sample.SAMPLE_ABOVE): each decision scores a sample, and the sample always
    holds the endpoint that has the request's prefix, so one conversation's turns stay on one rank."""
    f = Fleet(tmp_path, 80)
    router = RouterServer("--upstreams", ",".join(f.urls), "--debug-headers", "--kv-events", "off",
                          log=tmp_path / "router.log")
    try:
        router.wait_ready()
        _until(lambda: sum((e.get("telemetry_push") or {}).get("state") == "pushed"
                           for e in router.status()["endpoints"]) == 80, 60)
        system = " ".join(f"word{i}" for i in range(400))
        chosen = []
        with httpx.Client(timeout=30) as client:
            for turn in range(12):
                r = client.post(router.url + "/v1/completions", json={
                    "model": "standin-model", "prompt": f"{system} question {turn}", "max_tokens": 2})
                assert r.status_code == 200, r.text
                chosen.append(r.headers["x-lbd-endpoint"])
        top = max(set(chosen), key=chosen.count)
        assert chosen.count(top) >= 10, chosen
    finally:
        router.close()
        stop(f.proc)


def test_a_curve_stream_is_followed_only_with_the_cluster_token(tmp_path: Path) -> None:
    """Streams secured with the cluster token: a router holding it follows them; one without it (or with
    another token) cannot complete the handshake and scrapes those ranks instead."""
    token = {"LBD_CLUSTER_TOKEN": "fleet-test-9cW4n1xQ0rTz7LkV2bS8mYpH3uJ6eA5dFgR0iOq1wXc"}  # 256+ bits
    f = Fleet(tmp_path, 2, "--curve", env=token)
    routers = {
        "right": RouterServer("--upstreams", ",".join(f.urls), log=tmp_path / "r1.log", env=token),
        "none": RouterServer("--upstreams", ",".join(f.urls), log=tmp_path / "r2.log",
                             env={"LBD_CLUSTER_TOKEN": ""}),
        "wrong": RouterServer("--upstreams", ",".join(f.urls), log=tmp_path / "r3.log",
                              env={"LBD_CLUSTER_TOKEN": "other-Hs2Jq8Wv5Lx1Nc7Rb0Tz4Yk9Pm3Gd6Fa2Ue8Io5Qw1"}),
    }
    try:
        for r in routers.values():
            r.wait_ready()
        _until(lambda: all(_push(routers["right"], u).get("state") == "pushed" for u in f.urls), 10)
        f.act(0, "set", {"running": 6, "waiting": 3})
        for r in routers.values():  # pushed or scraped, every router ends with the rank's numbers
            _until(lambda r=r: _views_match(r, f.urls), 5)
        assert all(_push(routers["none"], u) == {} for u in f.urls)  # no token: not even tried
        assert all(_push(routers["wrong"], u).get("messages", 0) == 0 for u in f.urls)
    finally:
        for r in routers.values():
            r.close()
        stop(f.proc)
