"""`lbd supervise` with real engine ranks on the tiny model: readiness, hangs, crashes, drain, a rolling
restart under load through `lbd route`, shutdown.

One supervised node of two ranks is shared by the tests of this module, in order; each test leaves it with
both ranks ready, and the last one shuts it down with SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from support import RouterServer, metric_value
from support.node import SupervisorNode, gone_within

TOKEN = "t0ken"
STREAM_TOKENS = 160


def chat(url: str, model: str, max_tokens: int = 2) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].finish_reason


class Stream(threading.Thread):
    """A streaming chat request that must run to its last token (ignore_eos)."""

    def __init__(self, url: str, model: str, max_tokens: int = STREAM_TOKENS) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.first = threading.Event()
        self.finish: str | None = None
        self.tokens: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            client = OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
            stream = client.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "count"}], max_tokens=self.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            for chunk in stream:
                self.first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first.set()

    def check(self) -> None:
        self.join(120)
        assert self.error is None, repr(self.error)
        assert self.finish == "length" and self.tokens == self.max_tokens, (self.finish, self.tokens)


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    log = tmp_path_factory.mktemp("supervisor") / "node.log"
    sup = SupervisorNode(tiny_llama, 2, "--admin-token", TOKEN, "--shutdown-timeout", "20",
                         "--restart-backoff-initial-s", "0.5", "--restart-backoff-reset-s", "3", log=log)
    try:
        yield sup
    finally:
        sup.close()


def test_ready_only_when_both_ranks_serve(node: SupervisorNode, tiny_llama: Path) -> None:
    codes = []
    node.wait_for(lambda: codes.append(node.get("/readyz").status_code) or codes[-1] == 200, 240,
                  "/readyz 200")
    assert codes[0] == 503 and codes[-1] == 200, codes
    assert node.get("/health").status_code == 200
    node.wait_ready()
    status = node.status()
    assert status["ready"] and status["phase"] == "running" and status["data_parallel_size"] == 2
    for i, rank in enumerate(status["ranks"]):
        assert rank["rank"] == i and rank["port"] == node.base_port + i and rank["pid"] > 0
        assert rank["state"] == "ready" and rank["routable"] and rank["restarts"] == 0
        assert rank["url"] == node.rank_url(i) and rank["last_probe_latency_s"] is not None
        assert chat(rank["url"], str(tiny_llama)) in ("length", "stop")
        metrics = httpx.get(rank["url"] + "/metrics", timeout=10).text
        assert f'engine="{i}"' in metrics
        assert metric_value(metrics, "vllm:request_success_total", engine=str(i)) >= 1
    sup_metrics = node.get("/metrics").text
    assert metric_value(sup_metrics, "lbd_supervisor_rank_ready", rank="0") == 1
    assert metric_value(sup_metrics, "lbd_supervisor_rank_ready", rank="1") == 1
    assert metric_value(sup_metrics, "lbd_supervisor_ready") == 1
    assert "lbd_supervisor_probe_duration_seconds_count" in sup_metrics



def test_autoscale_gauges_read_the_ranks(node: SupervisorNode) -> None:
    """Issue 46: lbd_supervisor_autoscale_* on the health port, from each ready rank's /telemetry (read in
    the background on a scrape, never waited for): idle, both ranks read, nothing queued, 1 recommended."""
    node.wait_ready()

    def gauges() -> dict[str, float]:
        text = node.get("/metrics").text
        return {k: metric_value(text, f"lbd_supervisor_autoscale_{k}")
                for k in ("ranks", "saturation", "token_backlog", "recommended_ranks", "ttft_target_seconds")}

    node.wait_for(lambda: gauges()["ranks"] == 2, 10, "both ranks' load read")
    assert gauges() == {"ranks": 2, "saturation": 0, "token_backlog": 0, "recommended_ranks": 1,
                        "ttft_target_seconds": 2.0}

def test_hung_rank_is_detected_and_restarted(node: SupervisorNode, tiny_llama: Path) -> None:
    node.wait_ready()
    node.signal_rank(1, signal.SIGSTOP)
    t_stop = time.monotonic()
    node.wait_for(lambda: node.rank(1)["state"] != "ready", 30, "rank 1 unhealthy", interval=0.02)
    detected = time.monotonic() - t_stop
    assert detected <= node.detection_bound_s + 1.0, (detected, node.detection_bound_s)
    assert node.get("/readyz").status_code == 503  # policy all
    # Health answers do not wait on the hung rank (its probes take the whole timeout).
    latencies = []
    for _ in range(30):
        t0 = time.perf_counter()
        assert node.get("/status").status_code == 200
        latencies.append(time.perf_counter() - t0)
    assert max(latencies) < node.timeout / 2, latencies
    assert chat(node.rank_url(0), str(tiny_llama)) in ("length", "stop")  # the other rank serves on
    node.wait_for(lambda: node.rank(1)["state"] == "ready" and node.rank(1)["restarts"] >= 1, 120,
                  "rank 1 restarted")
    assert node.get("/readyz").status_code == 200
    rank = node.rank(1)
    assert "no answer" in rank["last_failure"] and rank["consecutive_failures"] == 0
    sup_metrics = node.get("/metrics").text
    assert metric_value(sup_metrics, "lbd_supervisor_probe_failures_total", rank="1",
                        reason="timeout") >= node.threshold
    assert metric_value(sup_metrics, "lbd_supervisor_rank_restarts_total", rank="1") >= 1


def test_killed_rank_restarts_while_the_other_serves(node: SupervisorNode, tiny_llama: Path) -> None:
    node.wait_ready()
    # Ready longer than --restart-backoff-reset-s: this second failure of rank 1 gets the initial delay again.
    node.wait_for(lambda: node.rank(1)["ready_for_s"] > 3.5, 30, "rank 1 ready for a while")
    before = node.rank(1)["restarts"]
    old_tree = node.rank_tree(1)
    assert len(old_tree) >= 2  # the launcher (front end 0) and its core
    failures: list[BaseException] = []
    done = threading.Event()
    count = 0

    def hammer() -> None:
        nonlocal count
        while not done.is_set():
            try:
                chat(node.rank_url(0), str(tiny_llama))
                count += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)

    worker = threading.Thread(target=hammer, daemon=True)
    worker.start()
    try:
        old_pid = node.signal_rank(1, signal.SIGKILL)
        node.wait_for(lambda: node.rank(1)["state"] != "ready", 30, "rank 1 noticed dead")
        node.wait_for(lambda: node.rank(1)["state"] == "ready" and node.rank(1)["restarts"] == before + 1,
                      120, "rank 1 restarted")
    finally:
        done.set()
        worker.join(60)
    assert not failures, failures[:3]
    assert count > 0
    assert node.rank(1)["pid"] != old_pid
    assert "SIGKILL" in node.rank(1)["last_failure"]
    assert not gone_within(old_tree, 5.0)  # the killed launcher's core went with it
    assert node.log_text().count("rank 1: restarting in 0.5 s") == 2  # hang, then kill: no doubling


def test_admin_endpoints_need_the_token(node: SupervisorNode) -> None:
    for path in ("/ranks/0/drain", "/ranks/0/restart", "/rolling-restart"):
        r = node.post(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = node.post(path, token="wrong")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    r = node.post("/ranks/7/drain", token=TOKEN)
    assert r.status_code == 404 and r.json()["error"]["param"] == "rank"
    r = node.post("/ranks/x/restart", token=TOKEN)
    assert r.status_code == 400
    assert node.get("/nope").json()["error"]["code"] == 404


def test_drain_lets_in_flight_requests_finish(node: SupervisorNode, tiny_llama: Path) -> None:
    node.wait_ready()
    before = node.rank(0)["restarts"]
    stream = Stream(node.rank_url(0), str(tiny_llama))
    stream.start()
    assert stream.first.wait(60)
    r = node.post("/ranks/0/drain", token=TOKEN)
    assert r.status_code == 202, r.text
    assert r.json() == {"rank": 0, "action": "drain", "accepted": True}
    node.wait_for(lambda: node.rank(0)["state"] == "draining", 10, "rank 0 draining")
    assert not node.rank(0)["routable"]
    assert node.post("/ranks/0/restart", token=TOKEN).status_code == 409  # one command at a time
    stream.check()
    node.wait_for(lambda: node.rank(0)["state"] == "ready" and node.rank(0)["restarts"] == before + 1, 120,
                  "rank 0 back after the drain")


class Load:
    """Streaming and plain completions through a router, back to back until stopped; every one must succeed
    whole (12 tokens, [DONE] and no error event for a stream)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.failures: list[str] = []
        self.counts = {"stream": 0, "plain": 0}
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True)
                        for s in (True, False, True, False)]
        for t in self.threads:
            t.start()

    def _run(self, stream: bool) -> None:
        body = {"model": self.model, "prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.done.is_set():
                try:
                    if stream:
                        with c.stream("POST", "/v1/completions", json=body) as r:
                            text = "".join(r.iter_text())
                        ok = r.status_code == 200 and text.endswith("data: [DONE]\n\n") and \
                            '"error"' not in text
                    else:
                        r = c.post("/v1/completions", json=body)
                        text = r.text
                        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
                    if ok:
                        self.counts["stream" if stream else "plain"] += 1
                    else:
                        self.failures.append(f"{r.status_code}: {text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(60)


@pytest.mark.slow
def test_rolling_restart_one_rank_at_a_time_under_load_fails_no_request(
        node: SupervisorNode, tiny_llama: Path, tmp_path: Path) -> None:
    """A rolling restart under load through a router loses no request: the supervisor marks each rank
    draining in /status first, the router (following it) stops sending there, in-flight requests finish,
    then the rank restarts, never both at once. (Was two tests, this one and test_rolling_restart_load.py's,
    each on its own node: one node and one rolling restart now check both.)"""
    node.wait_ready()
    router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy", "least_load",
                          log=tmp_path / "router.log").wait_ready()
    load = Load(router.url, str(tiny_llama))
    try:
        node.wait_for(lambda: min(load.counts.values()) >= 2, 60, "the load to flow")
        before = [r["restarts"] for r in node.status()["ranks"]]
        r = node.post("/rolling-restart", token=TOKEN)
        assert r.status_code == 202, r.text
        assert node.post("/rolling-restart", token=TOKEN).status_code == 409
        max_down = 0
        saw_draining: set[int] = set()

        def finished() -> bool:
            nonlocal max_down
            status = node.status()
            max_down = max(max_down, sum(r["state"] != "ready" for r in status["ranks"]))
            saw_draining.update(r["rank"] for r in status["ranks"] if r["state"] == "draining")
            return status["rolling_restart"]["state"] != "running"

        node.wait_for(finished, 240, "rolling restart")
        status = node.status()
        assert status["rolling_restart"]["state"] == "done", status["rolling_restart"]
        assert status["rolling_restart"]["done_ranks"] == [0, 1]
        assert [r["restarts"] for r in status["ranks"]] == [b + 1 for b in before]
        assert max_down == 1  # never both at once
        assert saw_draining == {0, 1}  # each was draining (and seen so) before it stopped
        assert node.get("/readyz").status_code == 200
        mid = dict(load.counts)  # and both kinds are served again through the router
        node.wait_for(lambda: all(load.counts[k] > mid[k] for k in mid), 30, "requests after the restart")
    finally:
        load.stop()
        router.close()
    assert not load.failures, load.failures[:5]
    assert load.counts["stream"] >= 10 and load.counts["plain"] >= 10, load.counts


def test_prestop_and_sigterm_let_streams_finish_and_stop_everything(node: SupervisorNode,
                                                                    tiny_llama: Path) -> None:
    node.wait_ready()
    streams = [Stream(node.rank_url(i), str(tiny_llama)) for i in range(2)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60)
    tree = node.descendants()
    assert len(tree) >= 4  # two launchers, two cores
    # Kubernetes' order (docker/k8s/base/node.yaml): the preStop hook drains every rank (routers stop
    # sending, the streams go on), then SIGTERM
    hook = subprocess.run([sys.executable, "-m", "lbd.supervisor.prestop", "--node", node.url,
                           "--settle-s", "0.2"], env={**os.environ, "LBD_ADMIN_TOKEN": TOKEN},
                          capture_output=True, text=True, timeout=30)
    assert hook.returncode == 0 and "draining ranks [0, 1]" in hook.stderr, hook.stderr
    assert [(r["state"], r["routable"]) for r in node.status()["ranks"]] == [("draining", False)] * 2
    t0 = time.monotonic()
    node.proc.send_signal(signal.SIGTERM)
    # "at once": the signal is handled on the supervisor's loop, so allow it a moment on a busy machine
    deadline = time.monotonic() + 2.0
    while "stopping" not in (r := node.get("/readyz")).text and time.monotonic() < deadline:
        time.sleep(0.02)
    assert r.status_code == 503 and "stopping" in r.text
    assert node.get("/status").json()["phase"] == "stopping"
    for s in streams:
        s.check()
    assert node.proc.wait(60) == 0
    assert time.monotonic() - t0 < 20 + 5 + 10
    assert not gone_within(tree, 5.0)
