"""The Grafana dashboards (docker/grafana/dashboards) only name metrics our processes export: every metric in
their PromQL is found on a real router, supervisors, `lbd serve` nodes of a DP group and engine ranks after
some traffic. Also: the JSON is what
docker/grafana/make_dashboards.py writes, and the monitoring manifests name ports that exist."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from support import free_port_run, spawn, stop, wait_http

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "docker" / "grafana" / "dashboards"
_NAME = re.compile(r"(?<![\w:])((?:vllm:|lbd_)[A-Za-z0-9_:]+)")


def promql(dashboard: Path) -> list[str]:
    data = json.loads(dashboard.read_text())
    exprs = [t["expr"] for p in data["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in data["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def metric_names(exprs: list[str]) -> set[str]:
    return {m for e in exprs for m in _NAME.findall(e)}


def exported(name: str, text: str) -> bool:
    """A sample of ``name`` is in the exposition, or its family is declared (a labelled counter before its
    first event has a TYPE line and no sample)."""
    if re.search(rf"^{re.escape(name)}[{{ ]", text, re.M):
        return True
    base = re.sub(r"_(total|bucket|sum|count)$", "", name)
    return any(re.search(rf"^# TYPE {re.escape(n)} ", text, re.M) for n in (name, base))


def test_json_is_what_the_generator_writes() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "docker" / "grafana" / "make_dashboards.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    for path in DASHBOARDS.glob("*.json"):
        data = json.loads(path.read_text())
        ids = [p["id"] for p in data["panels"]]
        panels = [p for p in data["panels"] if p["type"] != "row"]
        assert len(ids) == len(set(ids)) and all(p["datasource"]["uid"] == "${datasource}" for p in panels)


def test_monitoring_manifests_name_existing_ports() -> None:
    k8s = ROOT / "docker" / "k8s"
    node = list(yaml.safe_load_all((k8s / "base" / "node.yaml").read_text()))
    sts = next(d for d in node if d["kind"] == "StatefulSet")
    pod_ports = {p["name"] for c in sts["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    pm = yaml.safe_load((k8s / "monitoring" / "podmonitor.yaml").read_text())
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= pod_ports
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    router = list(yaml.safe_load_all((k8s / "base" / "router.yaml").read_text()))
    svc = next(d for d in router if d["kind"] == "Service")
    sm = yaml.safe_load((k8s / "monitoring" / "servicemonitor.yaml").read_text())
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    prom = yaml.safe_load((ROOT / "docker" / "prometheus" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in prom["scrape_configs"]} == {"lbd-router", "lbd-supervisor", "lbd-engine"}


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """An `lbd serve` DP group of two nodes on loopback: a head (router, registration service, rank 0) and a
    --headless node (rank 1), so every process kind the dashboards watch runs: `lbd route`, `lbd supervise`
    (under each node's health port) and engine ranks. Yields (router, head health, headless health) URLs."""
    tmp = tmp_path_factory.mktemp("dash")
    base = free_port_run(8)
    group = ["--model", str(tiny_llama), "--device", "sim", "--max-model-len", "512", "--log-level",
             "warning", "--served-model-name", "tiny", "--data-parallel-size", "2",
             "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", str(base + 7), "--dp-supervisor-probe-interval-s", "0.5"]
    head = spawn([sys.executable, "-m", "lbd", "serve", *group, "--port", str(base),
                  "--data-parallel-supervisor-port", str(base + 2)], log=tmp / "head.log")
    worker = spawn([sys.executable, "-m", "lbd", "serve", *group, "--headless", "--data-parallel-start-rank",
                    "1", "--port", str(base + 3), "--data-parallel-supervisor-port", str(base + 4)],
                   log=tmp / "worker.log")
    urls = (f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 2}", f"http://127.0.0.1:{base + 4}")
    try:
        for url, proc in ((urls[2], worker), (urls[1], head), (urls[0], head)):
            wait_http(url + "/readyz", 120, proc)
        yield urls
    finally:
        codes = [stop(p) for p in (worker, head)]
        assert codes == [0, 0], (tmp / "head.log").read_text()[-3000:]


async def test_every_dashboard_metric_is_exported(deployment: tuple[str, str, str]) -> None:
    router, head, headless = deployment
    async with httpx.AsyncClient(timeout=30) as c:
        for i in range(4):
            r = await c.post(router + "/v1/completions",
                             json={"model": "tiny", "prompt": f"dashboards {i}", "max_tokens": 3})
            assert r.status_code == 200, r.text
        ranks = (await c.get(head + "/status")).json()["ranks"]
        assert sorted(r["rank"] for r in ranks) == [0, 1]
        texts = {"lbd-router.json": (await c.get(router + "/metrics")).text,
                 # the supervisor's families and lbd serve's (group nodes on the head, registration on
                 # the headless node) share the health port
                 "lbd-supervisor.json": (await c.get(head + "/metrics")).text
                 + (await c.get(headless + "/metrics")).text,
                 "lbd-engine.json": "".join([(await c.get(r["url"] + "/metrics")).text for r in ranks])}
    assert set(texts) == {p.name for p in DASHBOARDS.glob("*.json")}
    for name, text in texts.items():
        names = metric_names(promql(DASHBOARDS / name))
        assert len(names) >= 8, (name, names)
        missing = sorted(m for m in names if not exported(m, text))
        assert not missing, f"{name} queries metrics nobody exports: {missing}"
