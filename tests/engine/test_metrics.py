"""Every vLLM metric family lbd implements, scraped from a real engine and a sim engine after traffic, with
vLLM's type, buckets and labels.

``VLLM_FAMILIES`` is transcribed from vLLM 0.32's ``vllm/v1/metrics/loggers.py`` (PrometheusStatLogger) and
``buckets.py``, independently of ``engine/metrics.py``: a rename, a type change or a bucket change on our
side fails here. The README ("Metrics") lists vLLM's families lbd leaves out and why.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support import EngineServer

MAX_MODEL_LEN = 512
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
           480.0, 960.0, 1920.0, 7680.0]
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
       80.0]
TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # vLLM's 1-2-5 series capped at max_model_len (512)
ENGINE = ("model_name", "engine")

# name -> (type, buckets or None, label names besides le)
VLLM_FAMILIES: dict[str, tuple[str, list[float] | None, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", None, ENGINE),
    "vllm:num_requests_waiting": ("gauge", None, ENGINE),
    "vllm:num_requests_waiting_by_reason": ("gauge", None, (*ENGINE, "reason")),
    "vllm:kv_cache_usage_perc": ("gauge", None, ENGINE),
    "vllm:prefix_cache_queries": ("counter", None, ENGINE),
    "vllm:prefix_cache_hits": ("counter", None, ENGINE),
    "vllm:num_preemptions": ("counter", None, ENGINE),
    "vllm:prompt_tokens": ("counter", None, ENGINE),
    "vllm:prompt_tokens_by_source": ("counter", None, (*ENGINE, "source")),
    "vllm:prompt_tokens_cached": ("counter", None, ENGINE),
    "vllm:prompt_tokens_cached_by_source": ("counter", None, (*ENGINE, "source")),
    "vllm:generation_tokens": ("counter", None, ENGINE),
    "vllm:request_success": ("counter", None, (*ENGINE, "finished_reason")),
    "vllm:admission_rejections": ("counter", None, ("model_name", "reason")),
    "vllm:request_prompt_tokens": ("histogram", TOKENS, ENGINE),
    "vllm:request_generation_tokens": ("histogram", TOKENS, ENGINE),
    "vllm:iteration_tokens_total": ("histogram", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                  16384], ENGINE),
    "vllm:request_max_num_generation_tokens": ("histogram", TOKENS, ENGINE),
    "vllm:request_params_n": ("histogram", [1, 2, 5, 10, 20], ENGINE),
    "vllm:request_params_max_tokens": ("histogram", TOKENS, ENGINE),
    "vllm:time_to_first_token_seconds": ("histogram", TTFT, ENGINE),
    "vllm:inter_token_latency_seconds": ("histogram", ITL, ENGINE),
    "vllm:request_time_per_output_token_seconds": ("histogram", ITL, ENGINE),
    "vllm:e2e_request_latency_seconds": ("histogram", LATENCY, ENGINE),
    "vllm:request_queue_time_seconds": ("histogram", LATENCY, ENGINE),
    "vllm:request_inference_time_seconds": ("histogram", LATENCY, ENGINE),
    "vllm:request_prefill_time_seconds": ("histogram", LATENCY, ENGINE),
    "vllm:request_decode_time_seconds": ("histogram", LATENCY, ENGINE),
    "vllm:request_num_preemptions": ("histogram", [1, 2, 3, 4, 5, 10, 20], ENGINE),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", TOKENS, ENGINE),
}
# vLLM's label values that are always present (pre-created children)
LABEL_VALUES = {
    ("vllm:request_success", "finished_reason"): {"stop", "length", "abort", "error", "repetition"},
    ("vllm:admission_rejections", "reason"): {"max_num_queued_reqs", "max_num_queued_tokens"},
    ("vllm:prompt_tokens_by_source", "source"): {"local_compute", "local_cache_hit", "external_kv_transfer"},
    ("vllm:prompt_tokens_cached_by_source", "source"): {"device", "host", "p2p", "disk",
                                                        "external_unspecified"},
    ("vllm:num_requests_waiting_by_reason", "reason"): {"capacity", "deferred"},
}
# vllm:cache_config_info: a gauge at 1 labelled with CacheConfig fields + engine (vLLM: every field)
CACHE_CONFIG_FIELDS = {"block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "kv_cache_memory_bytes", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
                       "sliding_window", "is_attention_free", "prefix_caching_hash_algo", "swap_space",
                       "cpu_offload_gb", "engine"}


def _traffic(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        shared = "Once upon a time there was a tiny model that learned to count. " * 3
        for i in range(3):  # n=2 and a shared prefix: prefix-cache hits, params_n, max_num_generation_tokens
            body = {"model": model, "prompt": shared + str(i), "max_tokens": 6 + i, "n": 2,
                    "temperature": 0.5, "seed": i, "ignore_eos": True}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "stream": True, "ignore_eos": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and any("[DONE]" in line for line in r.iter_lines())


@pytest.fixture(scope="module")
def scraped(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = {}
    for device in ("cpu", "sim"):
        log = tmp_path_factory.mktemp(f"metrics-{device}") / "engine.log"
        with EngineServer(tiny_llama, "--device", device, "--max-model-len", str(MAX_MODEL_LEN),
                          "--data-parallel-rank", "1", "--data-parallel-size", "2",
                          "--served-model-name", "tiny", log=log) as server:
            _traffic(server.base_url)
            time.sleep(0.3)  # idle: the core's counters are flushed (100 ms) and its last stats sent
            resp = httpx.get(server.base_url + "/metrics", timeout=10)
            out[device] = resp.text
            out[f"{device} advertises"] = resp.headers.get("x-lbd-telemetry", "")
            out[f"{device} telemetry"] = httpx.get(server.base_url + "/telemetry", timeout=10).text
    return out


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_every_implemented_vllm_family_with_vllms_type_buckets_and_labels(scraped: dict[str, str],
                                                                           device: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scraped[device])
                if f.name.startswith("vllm:")}
    missing = set(VLLM_FAMILIES) - set(families)
    assert not missing, f"families missing: {sorted(missing)}"
    for name, (kind, buckets, labels) in VLLM_FAMILIES.items():
        fam = families[name]
        assert fam.type == kind, (name, fam.type)
        assert fam.samples, name
        for sample in fam.samples:
            keys = set(sample.labels) - {"le"}
            assert keys == set(labels), (name, sample.labels)
            if "engine" in labels:
                assert (sample.labels["model_name"], sample.labels["engine"]) == ("tiny", "1"), sample
        if buckets is not None:
            les = sorted({float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket")})
            assert les == [float(b) for b in buckets] + [float("inf")], (name, les)
        for (family, label), values in LABEL_VALUES.items():
            if family == name:
                assert {s.labels[label] for s in fam.samples} == values, name
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge" and [s.value for s in info.samples] == [1.0]
    labels = info.samples[0].labels
    assert set(labels) <= CACHE_CONFIG_FIELDS, set(labels) - CACHE_CONFIG_FIELDS
    assert (labels["block_size"], labels["enable_prefix_caching"], labels["engine"]) == ("16", "True", "1")
    # The traffic shows up where vLLM puts it.
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def total(sample: str, **want: str) -> float:
        return sum(v for (n, lab), v in value.items() if n == sample and want.items() <= dict(lab).items())

    assert total("vllm:request_success_total", finished_reason="length") == 7  # 3 x n=2 + the chat stream
    assert total("vllm:e2e_request_latency_seconds_count") == 7
    assert total("vllm:request_params_n_count") == 4 and total("vllm:request_params_n_sum") == 7
    assert total("vllm:request_max_num_generation_tokens_sum") == 6 + 7 + 8 + 5
    assert total("vllm:request_queue_time_seconds_count") == 7
    assert total("vllm:prefix_cache_hits_total") > 0
    assert total("vllm:prompt_tokens_cached_by_source_total", source="device") == total(
        "vllm:prefix_cache_hits_total")
    assert total("vllm:prompt_tokens_by_source_total") == total("vllm:prompt_tokens_total")
    assert total("vllm:iteration_tokens_total_sum") >= total("vllm:generation_tokens_total")


def test_sim_engine_exports_the_same_families_as_a_real_one(scraped: dict[str, str]) -> None:
    def shape(text: str) -> dict[str, tuple[str, frozenset[str]]]:
        return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels))
                for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}

    assert shape(scraped["sim"]) == shape(scraped["cpu"])


@pytest.mark.parametrize("device", ["cpu", "sim"])
def test_telemetry_json_holds_the_numbers_a_router_reads_from_metrics(scraped: dict[str, str],
                                                                      device: str) -> None:
    """GET /telemetry (advertised by /metrics' X-LBD-Telemetry header) answers the same values as /metrics."""
    assert scraped[f"{device} advertises"] == "/telemetry"
    got = json.loads(scraped[f"{device} telemetry"])
    value = {s.name: s for f in text_string_to_metric_families(scraped[device]) for s in f.samples}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
                 "generation_tokens_total"):
        assert got[name] == value[f"vllm:{name}"].value, name
    info = value["vllm:cache_config_info"].labels
    assert got["block_size"] == int(info["block_size"])
    assert got["num_gpu_blocks"] == int(info["num_gpu_blocks"])
    assert (got["engine"], got["model_names"]) == (1, ["tiny"])
    assert got["prompt_tokens_total"] > 0 and got["generation_tokens_total"] >= 26
    assert 0.0 <= got["age_s"] < 5.0 and len(scraped[f"{device} telemetry"]) < 1024
