"""`lbd serve --data-parallel-size 2 --api-key K`: the key guards the API port (the router) and every rank,
travels to the children by environment (no command line shows it), stays off the health port, and the
connection limits given to `lbd serve` hold on the API port and the node's health port too. Found as an
attacker would: before, the router and the ranks of such a deployment served anyone without a key. And TLS on
every port of a one-node deployment. One deployment (keys and TLS together) checks both: the key checks do not
depend on the scheme, and each start of a DP node costs seconds of two shared cores."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from support import free_port_run, make_certs
from support.deploy_harness import SIM_FLAGS, ServeNode

KEY, ENV_KEY = "serve-secret-5d1e", "env-secret-0b77"


def test_serve_api_key_and_tls_guard_router_and_ranks(tiny_llama: Path, tmp_path: Path) -> None:
    """`lbd serve --data-parallel-size 2 --api-key K --ssl-certfile ... --ssl-keyfile ... --ssl-ca-certs ...`:
    the API port, the health port and both ranks speak HTTPS only, each part verifying the others against the
    CA; the openai SDK verifying against the test CA (made here) gets answers, with either key."""
    ca, cert, pem = make_certs(tmp_path / "pki")
    base = free_port_run(4)  # router, 2 ranks, health port
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-size", "2", "--host",
                      "127.0.0.1", "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3), "--dp-supervisor-probe-interval-s",
                      "0.5", "--dp-supervisor-probe-generate", "2", "--api-key", KEY, "--max-headers", "40",
                      "--ssl-certfile", str(cert), "--ssl-keyfile", str(pem), "--ssl-ca-certs", str(ca)],
                     tmp_path / "serve.log", port=base, health_port=base + 3, env={"VLLM_API_KEY": ENV_KEY})
    trust = ssl.create_default_context(cafile=str(ca))
    health, api = f"https://127.0.0.1:{base + 3}", f"https://127.0.0.1:{base}"
    ranks = [f"https://127.0.0.1:{base + 1}", f"https://127.0.0.1:{base + 2}"]
    try:
        for url, timeout in ((health, 180), (api, 30)):  # the node's readiness, then the router's
            node.wait_for(lambda u=url: httpx.get(u + "/readyz", verify=trust, timeout=5).status_code == 200,
                          timeout, f"{url}/readyz 200 over https")
        for key in (KEY, ENV_KEY):  # either key, through the router, with the openai SDK
            client = openai.OpenAI(base_url=api + "/v1", api_key=key, max_retries=0, timeout=60,
                                   http_client=httpx.Client(verify=trust))
            reply = client.chat.completions.create(model=str(tiny_llama), max_tokens=3,
                                                   messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message is not None
        chunks = list(client.completions.create(model=str(tiny_llama), prompt="Hello", max_tokens=3,
                                                stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        for url in (api, *ranks):
            assert httpx.get(url + "/v1/models", verify=trust, timeout=10).status_code == 401, url
            assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"}, verify=trust,
                             timeout=10).status_code == 401, url
        for url in (api, *ranks, health):
            assert httpx.get(url + "/health", verify=trust, timeout=10).status_code == 200, url  # no key
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
                httpx.get(url.replace("https://", "http://") + "/health", timeout=5)
            with pytest.raises(httpx.ConnectError):  # and the certificate is checked
                httpx.get(url + "/health", timeout=5)
        # the generation probes (every 2nd) carry the rank's key: nothing restarted meanwhile
        status = httpx.get(health + "/status", verify=trust, timeout=5).json()
        assert all(r["state"] == "ready" and r["restarts"] == 0 for r in status["ranks"]), status["ranks"]
        assert all(r["url"].startswith("https://") for r in status["ranks"]), status["ranks"]
        # no secret on the health port nor on any child's command line
        for path in ("/status", "/metrics", "/readyz"):
            text = httpx.get(health + path, verify=trust, timeout=5).text
            assert KEY not in text and ENV_KEY not in text, path
        children = psutil.Process(node.proc.pid).children(recursive=True)
        assert len(children) >= 4  # supervisor, router, two ranks (and their cores)
        for p in children:
            assert not any(KEY in a or ENV_KEY in a for a in p.cmdline()), p.cmdline()
        # --max-headers reaches the router and the node's health port: 41 headers are refused on both
        for port, answer in ((base, b"431"), (base + 3, b"400")):
            with trust.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10),
                                   server_hostname="127.0.0.1") as s:
                extra = "".join(f"X-H{i}: v\r\n" for i in range(41))
                s.sendall(f"GET /health HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
                assert s.recv(200).split(b" ", 2)[1] == answer, port
    finally:
        assert node.close() == 0
