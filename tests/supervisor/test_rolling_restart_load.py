"""Acceptance: a rolling restart of a 2-rank node under load loses no request. The supervisor marks each rank
draining in /status first, the router (following it) stops sending there, in-flight requests finish, then the
rank restarts; streaming and non-streaming clients through the router see only successes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from support import RouterServer
from support.node import SupervisorNode

TOKEN = "rolling-token"


@pytest.mark.slow
def test_rolling_restart_under_load_fails_no_request(tiny_llama: Path, tmp_path: Path) -> None:
    node = SupervisorNode(tiny_llama, 2, "--admin-token", TOKEN, "--shutdown-timeout", "10",
                          log=tmp_path / "node.log")
    router = None
    failures: list[str] = []
    done = threading.Event()
    counts = {"stream": 0, "plain": 0}
    try:
        node.wait_ready()
        router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy", "least_load",
                              log=tmp_path / "router.log").wait_ready()
        model = str(tiny_llama)

        def load(stream: bool) -> None:
            body = {"model": model, "prompt": "Hello there", "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "stream": stream}
            with httpx.Client(base_url=router.url, timeout=60) as c:
                while not done.is_set():
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
                            counts["stream" if stream else "plain"] += 1
                        else:
                            failures.append(f"{r.status_code}: {text[:200]}")
                    except httpx.HTTPError as e:
                        failures.append(repr(e))

        threads = [threading.Thread(target=load, args=(s,), daemon=True) for s in (True, False, True, False)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        before = [r["restarts"] for r in node.status()["ranks"]]
        assert node.post("/rolling-restart", token=TOKEN).status_code == 202
        saw_draining = set()

        def finished() -> bool:
            status = node.status()
            saw_draining.update(r["rank"] for r in status["ranks"] if r["state"] == "draining")
            return status["rolling_restart"]["state"] != "running"

        node.wait_for(finished, 240, "the rolling restart")
        status = node.status()
        assert status["rolling_restart"]["state"] == "done", status["rolling_restart"]
        assert [r["restarts"] for r in status["ranks"]] == [b + 1 for b in before]
        assert saw_draining == {0, 1}  # each was draining (and seen so) before it stopped
        mid = dict(counts)
        time.sleep(2.0)  # and both serve again through the router
        assert counts["stream"] > mid["stream"] and counts["plain"] > mid["plain"]
    finally:
        done.set()
        time.sleep(0.1)
        if router is not None:
            router.close()
        node.close()
    assert not failures, failures[:5]
    assert counts["stream"] >= 10 and counts["plain"] >= 10, counts
