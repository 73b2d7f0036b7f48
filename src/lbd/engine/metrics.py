"""The engine's Prometheus metrics: vLLM's v1 families, names, types, buckets and labels.

Every family of vLLM 0.32's ``PrometheusStatLogger`` that lbd can back with real numbers is here, so a
dashboard, alert or router written for vLLM works unchanged; the README lists the families left out (features
lbd does not have) and why. Labels are ``model_name`` and ``engine`` (= DP rank) as in vLLM.

Front ends and the core are separate processes, so metrics use prometheus-client's multiprocess mode: the
launcher points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh folder before anything imports prometheus_client,
every process records into it, and any front end's ``/metrics`` aggregates all of them.

Who records what (each family is recorded by exactly one kind of process, so nothing is counted twice):
- the core (``CoreMetrics``, once per engine step, only what changed): scheduler gauges, KV usage,
  prefix-cache queries/hits, preemptions, prompt/generation token counters, tokens per step, admission
  rejections, request_success, cache_config_info;
- each front end (``FrontendMetrics``, once per finished sequence): the per-request histograms. Timings are
  vLLM's: TTFT, ITL and e2e as the front end sees them; queue, prefill, decode and inference time from the
  core's own timestamps (queued, first scheduled, first and last token), which the core sends with a
  request's first and last outputs.
Outside multiprocess mode (unit tests in one process) the default registry is used.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess as _mp

LABELS = ("model_name", "engine")

# vLLM 0.32's default bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# lbd.engine.server.forwarded: what a rank did with a router's ids, and why it refused a field (400)
FORWARD_REFUSALS = ("signature", "expired", "replayed", "no_key")
FORWARD_OUTCOMES = ("used", "other_tokenizer", "disabled", "mismatch",
                    *(f"refused_{r}" for r in FORWARD_REFUSALS))


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to the context length (request token and max_tokens histograms)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out
            out.append(m * scale)
        scale *= 10


def _gauge(name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Gauge:
    return Gauge(name, doc, labels, multiprocess_mode="mostrecent")


class CoreMetrics:
    """What the core records, bound to one (model_name, engine) label pair."""

    def __init__(self, model_name: str, rank: int) -> None:
        lv = {"model_name": model_name, "engine": str(rank)}
        self.labels = lv
        self.num_requests_running = _gauge("vllm:num_requests_running",
                                           "Number of requests in model execution batches.").labels(**lv)
        self.num_requests_waiting = _gauge("vllm:num_requests_waiting",
                                           "Number of requests waiting to be processed.").labels(**lv)
        by_reason = _gauge("vllm:num_requests_waiting_by_reason",
                           "Number of waiting requests by reason: 'capacity' waits for scheduling capacity; "
                           "'deferred' is always 0 in lbd (no LoRA budget or KV transfer defers requests).",
                           (*LABELS, "reason"))
        self.waiting_capacity = by_reason.labels(**lv, reason="capacity")
        by_reason.labels(**lv, reason="deferred").set(0)
        self.kv_cache_usage_perc = _gauge("vllm:kv_cache_usage_perc",
                                          "KV-cache usage. 1 means 100 percent usage.").labels(**lv)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS).labels(**lv)

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            (*LABELS, "source"))
        self.prompt_computed = by_source.labels(**lv, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**lv, source="local_cache_hit")
        by_source.labels(**lv, source="external_kv_transfer")  # no KV connector: exported at 0
        cached_by = Counter("vllm:prompt_tokens_cached_by_source",
                            "Prefix-cache hit tokens by the cache tier that supplied them (lbd: device).",
                            (*LABELS, "source"))
        self.cached_on_device = cached_by.labels(**lv, source="device")
        for source in CACHE_HIT_SOURCES[1:]:
            cached_by.labels(**lv, source=source)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", LABELS,
                                          buckets=ITERATION_TOKENS_BUCKETS).labels(**lv)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"))
        self._success = {r: success.labels(**lv, finished_reason=r) for r in FINISH_REASONS}
        rejections = Counter("vllm:admission_rejections",
                             "Number of admission attempts rejected by a queue limit, by reason.",
                             ("model_name", "reason"))
        self._rejections = {r: rejections.labels(model_name=model_name, reason=r) for r in ADMISSION_REASONS}
        self._cache_config: Gauge | None = None
        self._lora: LoraMetrics | None = None

    def set_lora(self, state: object) -> None:
        """The adapters' state (a ``lbd.wire.core_messages.LoraState``), under --enable-lora."""
        if self._lora is None:
            self._lora = LoraMetrics(self.labels)
        self._lora.update(state)

    def request_success(self, finished_reason: str) -> Counter:
        child = self._success.get(finished_reason)
        return child if child is not None else self._success["abort"]

    def admission_rejection(self, reason: str) -> None:
        child = self._rejections.get(reason)
        if child is not None:
            child.inc()

    def set_cache_config(self, info: dict[str, object]) -> None:
        """vLLM's cache_config_info: one gauge at 1 whose labels are CacheConfig fields (as ``str()`` of the
        value) plus ``engine``; lbd fills the fields it has (block_size, num_gpu_blocks, cache_dtype, ...)."""
        labels = {k: str(v) for k, v in info.items()}
        labels["engine"] = self.labels["engine"]
        if self._cache_config is None:
            self._cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                       tuple(labels), multiprocess_mode="mostrecent")
        self._cache_config.labels(**labels).set(1)


class LoraMetrics:
    """vLLM's ``vllm:lora_requests_info`` (labels ``max_lora``, ``waiting_lora_adapters``,
    ``running_lora_adapters``: comma-joined names; the value is the time it was set, so the newest series is
    the current one, as in vLLM) and what it lacks, which an adapter-aware router needs: ``lbd:lora_resident``
    (1 per adapter and place, ``device`` or ``cpu``; 0 once it left), ``lbd:lora_free_slots``,
    ``lbd:lora_next_evicted`` (1 for the adapter a load would take a slot from, 0 once it is not) and
    ``lbd:lora_load_seconds`` (each adapter's last load), ``lbd:lora_reads_total`` (adapters read from disk)
    and ``lbd:lora_slot_fills_total`` (adapters copied into a device slot: slot misses)."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                          ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                          multiprocess_mode="mostrecent")
        self.resident = Gauge("lbd:lora_resident", "LoRA adapters loaded on this rank, by place (device slot "
                              "or CPU cache): 1 while there.", (*LABELS, "lora_name", "where"),
                              multiprocess_mode="mostrecent")
        self.free_slots = _gauge("lbd:lora_free_slots",
                                 "Device LoRA slots holding no adapter.").labels(**labels)
        self.next_evicted = Gauge("lbd:lora_next_evicted", "The LoRA adapter a load would take a device "
                                  "slot from (the least recently used one no running request uses): 1 "
                                  "while it is.",
                                  (*LABELS, "lora_name"), multiprocess_mode="mostrecent")
        self.load_seconds = Gauge("lbd:lora_load_seconds", "Seconds the last load of each LoRA adapter took "
                                  "(read, check, build tensors).", (*LABELS, "lora_name"),
                                  multiprocess_mode="mostrecent")
        self.reads = Counter("lbd:lora_reads", "LoRA adapters read from disk into host memory.",
                             LABELS).labels(**labels)
        self.slot_fills = Counter("lbd:lora_slot_fills", "LoRA adapters copied into a device slot (a request "
                                  "found its adapter in no slot).", LABELS).labels(**labels)
        self._where: set[tuple[str, ...]] = set()  # (lora_name, where) flagged 1 on lbd:lora_resident
        self._evicts: set[tuple[str, ...]] = set()  # (lora_name,) flagged 1 on lbd:lora_next_evicted
        self._counted = (0, 0)  # (reads, slot fills) already added to the counters

    def _flags(self, gauge: Gauge, names: tuple[str, ...], before: set[tuple[str, ...]],
               now: set[tuple[str, ...]]) -> set[tuple[str, ...]]:
        """Set ``gauge`` to 1 for the label values in ``now`` and to 0 for those flagged ``before`` but not
        now; returns ``now``."""
        for values in before | now:
            labels = dict(zip(names, values, strict=True))
            gauge.labels(**self.labels, **labels).set(1 if values in now else 0)
        return now

    def update(self, s: object) -> None:
        self.info.labels(max_lora=str(s.max_lora), waiting_lora_adapters=",".join(s.waiting),
                         running_lora_adapters=",".join(s.running)).set_to_current_time()
        now = {(name, "device") for name in s.device} | {(name, "cpu") for name in s.cpu}
        self._where = self._flags(self.resident, ("lora_name", "where"), self._where, now)
        self.free_slots.set(s.free_slots)
        self._evicts = self._flags(self.next_evicted, ("lora_name",), self._evicts,
                                   {(s.evicts,)} if s.evicts else set())
        for name, seconds in s.load_seconds.items():
            self.load_seconds.labels(**self.labels, lora_name=name).set(seconds)
        reads, fills = self._counted
        self.reads.inc(max(0, s.reads - reads))
        self.slot_fills.inc(max(0, s.slot_fills - fills))
        self._counted = (max(reads, s.reads), max(fills, s.slot_fills))


class FrontendMetrics:
    """What each front end records, bound to one (model_name, engine) label pair."""

    def __init__(self, model_name: str, rank: int, max_model_len: int) -> None:
        lv = {"model_name": model_name, "engine": str(rank)}
        tokens = request_tokens_buckets(max_model_len)

        def hist(name: str, doc: str, buckets: tuple | list) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets).labels(**lv)

        self.time_to_first_token = hist("vllm:time_to_first_token_seconds",
                                        "Histogram of time to first token in seconds.",
                                        TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = hist("vllm:inter_token_latency_seconds",
                                        "Histogram of inter-token latency in seconds.",
                                        INTER_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = hist("vllm:request_time_per_output_token_seconds",
                                          "Histogram of time_per_output_token_seconds per request.",
                                          INTER_TOKEN_LATENCY_BUCKETS)
        lat = REQUEST_LATENCY_BUCKETS
        self.e2e_request_latency = hist("vllm:e2e_request_latency_seconds",
                                        "Histogram of e2e request latency in seconds.", lat)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", lat)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", lat)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", lat)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", lat)
        self.num_preemptions = hist("vllm:request_num_preemptions",
                                    "Histogram of the number of times a request was preempted.",
                                    REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.prefill_kv_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                        "Histogram of new KV tokens computed during prefill "
                                        "(excluding cached tokens).", tokens)
        self.prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", tokens)
        self.max_num_generation_tokens = hist("vllm:request_max_num_generation_tokens",
                                              "Histogram of maximum number of requested generation tokens.",
                                              tokens)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                             REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        forwarded = Counter("lbd:forwarded_prompts", "Requests that came with a router's prompt token ids, "
                            "by what the rank did with them (server.forwarded).", (*LABELS, "outcome"))
        self.forwarded_prompts = {o: forwarded.labels(**lv, outcome=o) for o in FORWARD_OUTCOMES}


def render() -> bytes:
    """Exposition text of every process's metrics (multiprocess mode) or of this process's."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        _mp.MultiProcessCollector(registry)
        return generate_latest(registry)
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY)
