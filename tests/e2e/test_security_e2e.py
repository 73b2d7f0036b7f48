"""API keys, rate limits, TLS and redaction end to end with real clients: a supervised rank that serves HTTPS
and wants a key, behind a router that serves HTTPS, wants its own clients' keys (a key file, reloaded on
SIGHUP), rate-limits them, and authenticates to the rank with its own key. The CA and certificates are made
here (trustme); clients are the openai SDK and httpx verifying against that CA."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from support import RouterServer, make_certs
from support.node import SupervisorNode

ENGINE_KEY = "engine-secret-7f3a"
ADMIN_TOKEN = "admin-secret-91cc"
CLIENT_KEY = "client-secret-a1"
SLOW_KEY = "client-secret-slow"  # rps=1
FEW_TOKENS_KEY = "client-secret-tokens"  # tps=40
SECRETS = (ENGINE_KEY, ADMIN_TOKEN, CLIENT_KEY, SLOW_KEY, FEW_TOKENS_KEY)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, pki: tuple[Path, Path, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[SupervisorNode, RouterServer, Path]]:
    ca, cert, key = pki
    logs = tmp_path_factory.mktemp("security")
    node = SupervisorNode(tiny_llama, 1, "--api-key", ENGINE_KEY, "--admin-token", ADMIN_TOKEN,
                          "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), "--ssl-ca-certs", str(ca),
                          "--dp-supervisor-probe-generate", "2", timeout=5.0,  # a busy machine's generations
                          log=logs / "node.log", scheme="https",
                          verify=trusting(ca))
    keys = logs / "keys.txt"
    keys.write_text(f"{CLIENT_KEY} name=team-a\n{SLOW_KEY} name=slow rps=1\n"
                    f"{FEW_TOKENS_KEY} name=tokens tps=40  # a comment\n")
    router = None
    try:
        node.wait_ready(240)
        router = RouterServer("--upstreams", f"supervisor+https://127.0.0.1:{node.sport}", "--api-key-file",
                              str(keys), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                              "--ssl-ca-certs", str(ca), "--rate-limit-burst-s", "1", log=logs / "router.log",
                              env={"LBD_UPSTREAM_API_KEY": ENGINE_KEY}, scheme="https", verify=trusting(ca))
        router.wait_ready()
        yield node, router, keys
    finally:
        if router is not None:
            router.close()
        node.close()


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def sdk(url: str, key: str, ca: Path) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60,
                         http_client=httpx.Client(verify=trusting(ca)))


def test_openai_sdk_with_a_key_over_tls(deployment, pki, tiny_llama: Path) -> None:
    node, router, _ = deployment
    ca = pki[0]
    client = sdk(router.url, CLIENT_KEY, ca)
    reply = client.chat.completions.create(model=str(tiny_llama), max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.completions.create(model=str(tiny_llama), prompt="Hello", max_tokens=3, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.AuthenticationError):
        sdk(router.url, "wrong-key", ca).models.list()
    with pytest.raises(openai.AuthenticationError):  # the router keeps its clients' keys to itself:
        sdk(node.rank_url(0), CLIENT_KEY, ca).models.list()  # the rank does not know them
    assert [m.id for m in sdk(node.rank_url(0), ENGINE_KEY, ca).models.list()] == [str(tiny_llama)]
    for url in (router.url, node.rank_url(0), node.url):  # probes and scrapes need no key
        assert httpx.get(url + "/health", verify=trusting(ca)).status_code == 200
        assert httpx.get(url + "/metrics", verify=trusting(ca)).status_code == 200
    assert httpx.get(router.url + "/router/status", verify=trusting(ca)).status_code == 401
    with pytest.raises(httpx.ConnectError):  # TLS only, and only with a CA that signed the certificate
        httpx.get(router.url + "/health")
    with pytest.raises(httpx.HTTPError):
        httpx.get(router.url.replace("https", "http") + "/health")
    # the supervisor's generation probes (every 2nd) use the rank's key: the rank stays ready throughout
    assert node.rank(0)["state"] == "ready" and node.rank(0)["restarts"] == 0


def test_rate_limits_answer_429_with_retry_after(deployment, pki, tiny_llama: Path) -> None:
    _, router, _ = deployment
    ca = trusting(pki[0])
    body = {"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 1}
    with httpx.Client(base_url=router.url, verify=ca, timeout=30,
                      headers={"Authorization": f"Bearer {SLOW_KEY}"}) as c:
        codes = [c.post("/v1/completions", json=body) for _ in range(4)]
        limited = [r for r in codes if r.status_code == 429]
        assert codes[0].status_code == 200 and limited, [r.status_code for r in codes]
        err = limited[0].json()["error"]
        assert err["type"] == "RateLimitError" and "slow" in err["message"] and SLOW_KEY not in err["message"]
        wait = int(limited[0].headers["Retry-After"])
        assert 1 <= wait <= 2
        time.sleep(wait)
        assert c.post("/v1/completions", json=body).status_code == 200
    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=router.url, verify=ca, timeout=30,
                                     headers={"Authorization": f"Bearer {FEW_TOKENS_KEY}"}) as c:
            big = {**body, "max_tokens": 30}  # ~31 tokens of a 40-token bucket each
            return await asyncio.gather(*(c.post("/v1/completions", json=big) for _ in range(2)))

    codes = sorted(r.status_code for r in asyncio.run(two_at_once()))
    assert codes == [200, 429], codes
    # another key is not slowed by them
    client = sdk(router.url, CLIENT_KEY, pki[0])
    for _ in range(5):
        client.completions.create(model=str(tiny_llama), prompt="Hi", max_tokens=1)
    metrics = httpx.get(router.url + "/metrics", verify=ca).text
    assert 'lbd_router_rate_limited_total{key="slow"}' in metrics


def test_key_file_is_reloaded_on_sighup(deployment, pki, tiny_llama: Path) -> None:
    _, router, keys = deployment
    ca = trusting(pki[0])
    original = keys.read_text()
    new_key = "client-secret-new"
    try:
        keys.write_text(original.replace(f"{CLIENT_KEY} name=team-a", f"{new_key} name=team-b"))
        os.kill(router.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.get(router.url + "/v1/models", verify=ca,
                        headers={"Authorization": f"Bearer {new_key}"}).status_code != 200:
            assert time.monotonic() < deadline, router.log_text()[-2000:]
            time.sleep(0.1)
        assert httpx.get(router.url + "/v1/models", verify=ca,
                         headers={"Authorization": f"Bearer {CLIENT_KEY}"}).status_code == 401
    finally:
        keys.write_text(original)
        os.kill(router.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while httpx.get(router.url + "/v1/models", verify=ca,
                    headers={"Authorization": f"Bearer {CLIENT_KEY}"}).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_no_secrets_on_health_ports_or_logs(deployment, pki) -> None:
    node, router, _ = deployment
    ca = trusting(pki[0])
    status = node.get("/status")
    assert status.status_code == 200
    rank = status.json()["ranks"][0]
    assert rank["url"].startswith("https://") and "--api-key" not in rank["command"]
    seen = {
        "supervisor /status": status.text,
        "supervisor /metrics": node.get("/metrics").text,
        "supervisor /readyz": node.get("/readyz").text,
        "rank /metrics": httpx.get(node.rank_url(0) + "/metrics", verify=ca).text,
        "router /metrics": httpx.get(router.url + "/metrics", verify=ca).text,
        "router /router/status": httpx.get(router.url + "/router/status", verify=ca,
                                           headers={"Authorization": f"Bearer {CLIENT_KEY}"}).text,
        "supervisor and rank logs": node.log_text(),
        "router log": router.log_text(),
    }
    for where, text in seen.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} shows in {where}"
    # the ranks got the key through their environment, not a command line anyone can read in ps
    for proc in node.rank_tree(0):
        assert ENGINE_KEY not in " ".join(proc.cmdline())


def test_unverified_upstream_certificate_is_refused(deployment, tmp_path: Path) -> None:
    """A router without the CA that signed the rank's certificate does not talk to it (system trust store)."""
    node, _, _ = deployment
    other = RouterServer("--upstreams", node.rank_url(0), "--upstream-api-key", ENGINE_KEY,
                         "--scrape-timeout-ms", "300", "--health-failure-threshold", "1",
                         log=tmp_path / "router.log")
    try:
        other.wait_ready(path="/health")
        time.sleep(1.5)
        assert httpx.get(other.url + "/readyz").status_code == 503
        status = other.status()["endpoints"][0]
        assert status["state"] == "ejected" and "CERTIFICATE_VERIFY_FAILED" in (status["last_error"] or "")
    finally:
        other.close()
