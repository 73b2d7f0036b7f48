"""The engine's Prometheus metrics, with vLLM's names and labels (``model_name``, ``engine`` = DP rank).

Front ends and the core are separate processes, so metrics use prometheus-client's multiprocess mode: the
launcher points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder before anything imports prometheus_client,
every process records into it, and any front end's ``/metrics`` aggregates all of them.
Who records what: the core owns scheduler and cache state (gauges, prefix-cache, preemption, token and
success counters, cache_config_info); front ends own latencies as the client sees them (TTFT, ITL, e2e).
Outside multiprocess mode (unit tests in one process) the default registry is used.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as _mp

LABELS = ("model_name", "engine")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)


class EngineMetrics:
    """All engine metrics, bound to one (model_name, engine) label pair."""

    def __init__(self, model_name: str, rank: int) -> None:
        lv = {"model_name": model_name, "engine": str(rank)}
        self.labels = lv

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, multiprocess_mode="mostrecent").labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS).labels(**lv)

        self.num_requests_running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_cache_usage_perc = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix-cache queries, in tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.num_preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self._success = Counter("vllm:request_success", "Successfully finished requests.",
                                (*LABELS, "finished_reason"))
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", LABELS,
            buckets=_LATENCY_BUCKETS).labels(**lv)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", LABELS,
            buckets=_ITL_BUCKETS).labels(**lv)
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", LABELS,
            buckets=_LATENCY_BUCKETS).labels(**lv)
        self._cache_config = Gauge("vllm:cache_config_info", "Information of the KV cache config.",
                                   ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                                    *LABELS), multiprocess_mode="mostrecent")

    def request_success(self, finished_reason: str) -> Counter:
        return self._success.labels(**self.labels, finished_reason=finished_reason)

    def set_cache_config(self, block_size: int, num_blocks: int, cache_dtype: str,
                         prefix_caching: bool) -> None:
        self._cache_config.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks),
                                  cache_dtype=cache_dtype, enable_prefix_caching=str(prefix_caching),
                                  **self.labels).set(1)


def render() -> bytes:
    """Exposition text of every process's metrics (multiprocess mode) or of this process's."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        _mp.MultiProcessCollector(registry)
        return generate_latest(registry)
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY)
