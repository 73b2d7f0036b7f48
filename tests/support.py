"""Shared helpers for tests: the process and checkpoint helpers of ``lbd.bench`` (benchmarks use them too)
and test-only assertions."""

from __future__ import annotations

import json

from lbd.bench.procs import (  # noqa: F401  (re-exported for the tests)
    EngineServer,
    engine_server,
    exit_on_sigterm,
    free_port,
    free_port_run,
    spawn,
    stop,
    tree_usage,
    wait_http,
)
from lbd.bench.tiny import CHATML, make_tiny_llama, make_tokenizer  # noqa: F401


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labelpart = head.partition("{")
        if metric != name:
            continue
        pairs = dict(p.split("=", 1) for p in labelpart.rstrip("}").split(",") if "=" in p)
        pairs = {k: json.loads(v) for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total
