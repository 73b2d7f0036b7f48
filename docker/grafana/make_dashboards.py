"""Writes the Grafana dashboards of docker/grafana/dashboards/ (router, supervisor, engine) from the panel
lists below, so every panel has the same datasource variable, layout rules and ids. Rerun after editing:

    python docker/grafana/make_dashboards.py          # rewrites the three JSON files
    python docker/grafana/make_dashboards.py --check  # exit 1 if a JSON file is not what this writes

``tests/test_dashboards.py`` checks that every metric named in these PromQL expressions is exported by a real
router, supervisor and engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "[$__rate_interval]"
SEL = '{instance=~"$instance"}'


def _q(metric: str, quantile: float, by: str = "") -> str:
    group = f"le, {by}" if by else "le"
    return f"histogram_quantile({quantile}, sum by ({group}) (rate({metric}_bucket{SEL}{RATE})))"


def panel(title: str, exprs: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          width: int = 12, description: str = "") -> dict:
    return {"type": kind, "title": title, "description": description, "datasource": DS, "width": width,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"datasource": DS, "expr": e, "legendFormat": legend, "refId": chr(65 + i)}
                        for i, (e, legend) in enumerate(exprs)]}


def dashboard(uid: str, title: str, instance_metric: str, rows: list[tuple[str, list[dict]]]) -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row in rows:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            w = p.pop("width")
            if x + w > 24:
                x, y = 0, y + 8
            panels.append({"id": pid, "gridPos": {"h": 8, "w": w, "x": x, "y": y}, **p})
            pid, x = pid + 1, x + w
        y += 8
    variables = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {"name": "instance", "type": "query", "datasource": DS, "label": "Instance", "includeAll": True,
         "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
         "query": {"query": f"label_values({instance_metric}, instance)", "refId": "instance"},
         "definition": f"label_values({instance_metric}, instance)", "refresh": 2},
    ]
    return {"uid": uid, "title": title, "tags": ["lbd"], "timezone": "browser", "schemaVersion": 39,
            "version": 1, "editable": True, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": variables}, "panels": panels}


FLOW_MAX = "max by (instance, tenant, priority) "  # every worker of a router reports the router's totals


def router() -> dict:
    req = f"lbd_router_requests_total{SEL}"
    return dashboard("lbd-router", "lbd route", "lbd_router_requests_total", [
        ("Traffic", [
            panel("Requests by endpoint and status", [
                (f"sum by (endpoint, status) (rate({req}{RATE}))", "{{endpoint}} {{status}}")], "reqps"),
            panel("5xx share", [(f'sum(rate(lbd_router_requests_total{{instance=~"$instance",status=~"5.."}}'
                                 f"{RATE})) / sum(rate({req}{RATE}))", "5xx")], "percentunit"),
            panel("In flight per endpoint (all workers)", [
                (f"sum by (endpoint) (lbd_router_inflight_requests{SEL})", "{{endpoint}}")]),
            panel("Request duration, p50 and p99 by endpoint", [
                (_q("lbd_router_request_duration_seconds", 0.5, "endpoint"), "p50 {{endpoint}}"),
                (_q("lbd_router_request_duration_seconds", 0.99, "endpoint"), "p99 {{endpoint}}")], "s"),
        ]),
        ("Decisions", [
            panel("Decisions by policy and reason", [
                (f"sum by (policy, reason) (rate(lbd_router_decisions_total{SEL}{RATE}))",
                 "{{policy}}: {{reason}}")], "ops"),
            panel("Router overhead (arrival to dispatch), p50 / p99", [
                (_q("lbd_router_overhead_seconds", 0.5), "p50"),
                (_q("lbd_router_overhead_seconds", 0.99), "p99")], "s"),
            panel("Router overhead histogram", [
                (f"sum by (le) (increase(lbd_router_overhead_seconds_bucket{SEL}{RATE}))", "{{le}}")],
                kind="heatmap", width=24),
        ]),
        ("Failures", [
            panel("Retries by cause", [
                (f"sum by (reason) (rate(lbd_router_retries_total{SEL}{RATE}))", "{{reason}}")], "ops"),
            panel("Upstream errors by endpoint and kind", [
                (f"sum by (endpoint, kind) (rate(lbd_router_upstream_errors_total{SEL}{RATE}))",
                 "{{endpoint}} {{kind}}")], "ops"),
            panel("Ejections and re-admissions", [
                (f"sum by (endpoint) (increase(lbd_router_ejections_total{SEL}[5m]))",
                 "ejected {{endpoint}}"),
                (f"sum by (endpoint) (increase(lbd_router_readmissions_total{SEL}[5m]))",
                 "re-admitted {{endpoint}}")]),
            panel("Client disconnects", [
                (f"sum by (endpoint) (rate(lbd_router_client_disconnects_total{SEL}{RATE}))",
                 "{{endpoint}}")],
                "ops"),
            panel("Streams moved to another rank mid-answer, by cause and outcome", [
                (f"sum by (reason, outcome) (rate(lbd_router_migrations_total{SEL}{RATE}))",
                 "{{reason}}: {{outcome}}")], "ops"),
            panel("Moved streams: failure to next token, p50 / p99", [
                (_q("lbd_router_migration_gap_seconds", 0.5), "p50"),
                (_q("lbd_router_migration_gap_seconds", 0.99), "p99")], "s"),
        ]),
        ("Flow control", [
            panel("Held in the router, and served tokens/s, by tenant and class", [
                (f"sum by (tenant, priority) ({FLOW_MAX}(lbd_router_flow_queued{SEL}))",
                 "held {{tenant}} p{{priority}}"),
                (f"sum by (tenant, priority) ({FLOW_MAX}"
                 f"(rate(lbd_router_flow_served_tokens_total{SEL}{RATE})))",
                 "tokens/s {{tenant}} p{{priority}}"),
                (f"sum by (tenant, reason) (max by (instance, tenant, priority, reason) "
                 f"(rate(lbd_router_flow_shed_total{SEL}{RATE})))", "shed/s {{tenant}} {{reason}}")],
                width=24, description="lbd.router.flow: requests held while the pool is saturated, prompt "
                "and output tokens served, requests answered 429/503 instead of held (each worker of a "
                "router reports the router's totals: max per instance)"),
        ]),
        ("Telemetry", [
            panel("Endpoint takes traffic (1) or not (0)", [
                (f"min by (endpoint) (lbd_router_endpoint_healthy{SEL})", "{{endpoint}}")]),
            panel("Age of the last /metrics scrape", [
                (f"max by (endpoint) (lbd_router_scrape_age_seconds{SEL})", "{{endpoint}}")], "s",
                description="-1: never scraped"),
            panel("Age of the last pushed load state", [
                (f"max by (endpoint) (lbd_router_telemetry_push_age_seconds{SEL})", "{{endpoint}}")], "s"),
            panel("Pushed streams gone stale (scraped instead)", [
                (f"sum by (endpoint) (lbd_router_telemetry_push_stale{SEL})", "{{endpoint}}")]),
            panel("Failed scrapes", [
                (f"sum by (endpoint) (rate(lbd_router_scrape_errors_total{SEL}{RATE}))", "{{endpoint}}")],
                "ops"),
        ]),
    ])


def supervisor() -> dict:
    # lbd serve's router-only head runs no supervisor: list it by its own readiness gauge too
    instances = '{__name__=~"lbd_supervisor_ready|lbd_serve_ready"}'
    return dashboard("lbd-supervisor", "lbd supervise", instances, [
        ("Node", [
            panel("Ready ranks / ranks", [(f"sum(lbd_supervisor_ready_ranks{SEL})", "ready"),
                                          (f"sum(lbd_supervisor_ranks{SEL})", "ranks")],
                  kind="stat", width=8),
            panel("Node ready (/readyz 200)",
                  [(f"min by (instance) (lbd_supervisor_ready{SEL})", "{{instance}}")], kind="stat", width=8),
            panel("Node phase", [(f"max by (instance, phase) (lbd_supervisor_phase{SEL}) == 1",
                                  "{{instance}} {{phase}}")], kind="state-timeline", width=8),
        ]),
        ("Ranks", [
            panel("Rank state", [(f"max by (instance, rank, state) (lbd_supervisor_rank_state{SEL}) == 1",
                                  "{{instance}} rank {{rank}}: {{state}}")], kind="state-timeline", width=24),
            panel("Rank ready", [(f"max by (rank) (lbd_supervisor_rank_ready{SEL})", "rank {{rank}}")]),
            panel("Restarts in the last hour", [
                (f"sum by (rank) (increase(lbd_supervisor_rank_restarts_total{SEL}[1h]))", "rank {{rank}}")]),
        ]),
        ("Probes", [
            panel("Probe latency p50 / p99 by rank", [
                (_q("lbd_supervisor_probe_duration_seconds", 0.5, "rank"), "p50 rank {{rank}}"),
                (_q("lbd_supervisor_probe_duration_seconds", 0.99, "rank"), "p99 rank {{rank}}")], "s"),
            panel("Failed probes by rank and reason", [
                (f"sum by (rank, reason) (rate(lbd_supervisor_probe_failures_total{SEL}{RATE}))",
                 "rank {{rank}} {{reason}}")], "ops"),
        ]),
        # lbd serve's own gauges on the same health port: only deployments started with lbd serve have them
        ("Deployment and DP group (lbd serve)", [
            panel("Deployment ready (/readyz 200)",
                  [(f"min by (instance) (lbd_serve_ready{SEL})", "{{instance}}")], kind="stat", width=6),
            panel("Ranks by state (a head: the whole group)", [
                (f"max by (instance, state) (lbd_serve_ranks{SEL})", "{{instance}} {{state}}")], width=6,
                description="Each node's health port counts the ranks it answers for; a head counts "
                            "every rank of its group, missing ones included."),
            panel("Group nodes by lease state (head)", [
                (f"sum by (state) (lbd_serve_group_nodes{SEL})", "{{state}}")], width=6),
            panel("Nodes registered with their head", [
                (f"sum(lbd_serve_registered{SEL})", "registered"),
                (f"count(lbd_serve_registered{SEL})", "--headless nodes")], kind="stat", width=6),
        ]),
    ])


def engine() -> dict:
    by = "model_name, engine"

    def h(metric: str, q: float) -> str:
        return _q(metric, q, by)

    return dashboard("lbd-engine", "lbd engine (vLLM metrics)", "vllm:num_requests_running", [
        ("Load", [
            panel("Running and waiting requests", [
                (f"sum by ({by}) (vllm:num_requests_running{SEL})", "running {{engine}}"),
                (f"sum by ({by}) (vllm:num_requests_waiting{SEL})", "waiting {{engine}}")]),
            panel("KV-cache usage", [(f"max by ({by}) (vllm:kv_cache_usage_perc{SEL})", "{{engine}}")],
                  "percentunit"),
            panel("Tokens/s", [
                (f"sum by ({by}) (rate(vllm:prompt_tokens_total{SEL}{RATE}))", "prompt {{engine}}"),
                (f"sum by ({by}) (rate(vllm:generation_tokens_total{SEL}{RATE}))", "generation {{engine}}")]),
            panel("Prompt tokens by source", [
                (f"sum by (source) (rate(vllm:prompt_tokens_by_source_total{SEL}{RATE}))", "{{source}}")]),
        ]),
        ("Latency", [
            panel("Time to first token p50 / p99", [
                (h("vllm:time_to_first_token_seconds", 0.5), "p50 {{engine}}"),
                (h("vllm:time_to_first_token_seconds", 0.99), "p99 {{engine}}")], "s"),
            panel("Inter-token latency p50 / p99", [
                (h("vllm:inter_token_latency_seconds", 0.5), "p50 {{engine}}"),
                (h("vllm:inter_token_latency_seconds", 0.99), "p99 {{engine}}")], "s"),
            panel("End-to-end latency p50 / p99", [
                (h("vllm:e2e_request_latency_seconds", 0.5), "p50 {{engine}}"),
                (h("vllm:e2e_request_latency_seconds", 0.99), "p99 {{engine}}")], "s"),
            panel("Request phases, p50: queue, prefill, decode, inference", [
                (h("vllm:request_queue_time_seconds", 0.5), "queue {{engine}}"),
                (h("vllm:request_prefill_time_seconds", 0.5), "prefill {{engine}}"),
                (h("vllm:request_decode_time_seconds", 0.5), "decode {{engine}}"),
                (h("vllm:request_inference_time_seconds", 0.5), "inference {{engine}}")], "s"),
            panel("Time per output token p50", [
                (h("vllm:request_time_per_output_token_seconds", 0.5), "{{engine}}")], "s"),
        ]),
        ("Cache and scheduling", [
            panel("Prefix-cache hit rate", [
                (f"sum by ({by}) (rate(vllm:prefix_cache_hits_total{SEL}{RATE})) / sum by ({by}) "
                 f"(rate(vllm:prefix_cache_queries_total{SEL}{RATE}))", "{{engine}}")], "percentunit"),
            panel("Preemptions/s", [
                (f"sum by ({by}) (rate(vllm:num_preemptions_total{SEL}{RATE}))", "{{engine}}")]),
            panel("Tokens per engine step", [
                (f"sum by (le) (increase(vllm:iteration_tokens_total_bucket{SEL}{RATE}))", "{{le}}")],
                kind="heatmap"),
            panel("Admission rejections (queue limits)", [
                (f"sum by (reason) (rate(vllm:admission_rejections_total{SEL}{RATE}))", "{{reason}}")],
                "ops"),
        ]),
        ("Requests", [
            panel("Finished requests by reason", [
                (f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}{RATE}))",
                 "{{finished_reason}}")], "reqps"),
            panel("Prompt and output length p50", [
                (h("vllm:request_prompt_tokens", 0.5), "prompt {{engine}}"),
                (h("vllm:request_generation_tokens", 0.5), "output {{engine}}"),
                (h("vllm:request_params_max_tokens", 0.5), "max_tokens {{engine}}")]),
            panel("Cache config", [(f"max by (engine, block_size, num_gpu_blocks, cache_dtype) "
                                    f"(vllm:cache_config_info{SEL})", "{{engine}}")], kind="table", width=24),
        ]),
    ])


DASHBOARDS = {"lbd-router.json": router, "lbd-supervisor.json": supervisor, "lbd-engine.json": engine}


def main() -> int:
    stale = []
    for name, build in DASHBOARDS.items():
        text = json.dumps(build(), indent=1) + "\n"
        path = OUT / name
        if "--check" in sys.argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python docker/grafana/make_dashboards.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
