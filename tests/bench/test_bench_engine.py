"""`lbd bench` against a real engine process (`lbd serve --device sim` of the tiny Llama: the real front end,
scheduler, prefix cache and metrics, with sleeps for the forward pass, so no torch start-up): counts match
the engine's metrics, sane percentiles."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from support import EngineServer, free_port, metric_value

ROOT = Path(__file__).parents[2]
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("bench-engine") / "engine.log"
    sim = ("--device", "sim", "--kv-cache-memory-bytes", "1GiB")  # 1GiB: the profile's (Llama-3-8B) KV blocks
    with EngineServer(tiny_llama, *sim, "--max-model-len", "512", log=log) as server:
        yield server


def _counters(server: EngineServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return {name: metric_value(text, name) for name in COUNTERS}


def _bench(tiny_llama: Path, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lbd",
            "bench",
            "--tokenizer",
            str(tiny_llama),
            "--no-progress",
            "--result-json",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=240,
    )
    doc = orjson.loads(out.read_bytes()) if out.exists() else {}
    return proc, doc


def _sane(stats: dict) -> None:
    assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] + 1e-9
    assert stats["mean"] <= stats["max"]


def test_counts_and_percentiles_match_the_engine(
    engine: EngineServer, tiny_llama: Path, tmp_path: Path
) -> None:
    before = _counters(engine)
    proc, doc = _bench(
        tiny_llama,
        tmp_path,
        "--base-url",
        engine.base_url,
        "--num-prompts",
        "12",
        "--max-concurrency",
        "4",
        "--input-len",
        "40",
        "--output-len",
        "8",
        "--range-ratio",
        "0.3",
        "--seed",
        "5",
        "--slo",
        "ttft=60000",
    )
    after = _counters(engine)
    assert proc.returncode == 0, proc.stderr
    assert "Successful requests" in proc.stdout
    (run,) = doc["runs"]
    s, reqs = run["summary"], run["requests"]
    assert s["completed"] == 12 and s["failed"] == 0 and len(reqs) == 12
    delta = {k: after[k] - before[k] for k in COUNTERS}
    assert delta["vllm:request_success_total"] == 12
    assert (
        s["output_tokens"] == sum(r["output_tokens"] for r in reqs) == delta["vllm:generation_tokens_total"]
    )
    assert s["prompt_tokens"] == delta["vllm:prompt_tokens_total"]
    assert s["output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert all(r["output_tokens"] > 0 for r in reqs)
    assert s["goodput"] == pytest.approx(s["request_throughput"])
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        _sane(s[key])
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]
    assert s["duration_s"] * 1e3 >= s["e2e_ms"]["max"]
    for r in reqs:
        assert 0 < r["ttft"] <= r["e2e"]
        assert len(r["itl"]) <= r["output_tokens"] - 1
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-6
    assert s["max_concurrency_seen"] <= 4
    assert s["request_throughput"] == pytest.approx(12 / s["duration_s"])


def test_multi_turn_chat_history_grows_and_hits_the_prefix_cache(
    engine: EngineServer, tiny_llama: Path, tmp_path: Path
) -> None:
    before = _counters(engine)
    proc, doc = _bench(
        tiny_llama,
        tmp_path,
        "--base-url",
        engine.base_url,
        "--endpoint",
        "chat",
        "--workload",
        "multi-turn",
        "--num-groups",
        "2",
        "--system-prompt-len",
        "64",
        "--question-len",
        "12",
        "--num-turns",
        "3",
        "--output-len",
        "6",
        "--num-prompts",
        "9",
        "--max-concurrency",
        "3",
        "--session-header",
    )
    after = _counters(engine)
    assert proc.returncode == 0, proc.stderr
    reqs = doc["runs"][0]["requests"]
    assert len(reqs) == 9 and all(r["error"] is None for r in reqs)
    by_session: dict[str, list[dict]] = {}
    for r in reqs:
        by_session.setdefault(r["session_id"], []).append(r)
    assert len(by_session) == 3
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < turns[2]["prompt_tokens"]
        assert turns[0]["start"] + turns[0]["e2e"] <= turns[1]["start"] + 1e-6  # turns run in order
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] > 0


def test_open_loop_rate_warmup_and_duration(engine: EngineServer, tiny_llama: Path, tmp_path: Path) -> None:
    before = _counters(engine)
    proc, doc = _bench(
        tiny_llama,
        tmp_path,
        "--base-url",
        engine.base_url,
        "--num-prompts",
        "8",
        "--warmup",
        "3",
        "--request-rate",
        "8",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--seed",
        "1",
    )
    after = _counters(engine)
    assert proc.returncode == 0, proc.stderr
    starts = sorted(r["start"] for r in doc["runs"][0]["requests"])
    assert len(starts) == 8 and starts[-1] - starts[0] > 0.2  # spread by arrivals, not all at once
    # warm-up requests reach the engine but not the report
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 8 + 3
    assert doc["runs"][0]["summary"]["completed"] == 8

    proc, doc = _bench(
        tiny_llama,
        tmp_path,
        "--base-url",
        engine.base_url,
        "--duration",
        "1",
        "--max-concurrency",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
    )
    assert proc.returncode == 0, proc.stderr
    reqs = doc["runs"][0]["requests"]
    assert len(reqs) >= 2 and max(r["start"] for r in reqs) < 1.5


def test_compare_reports_each_target_and_errors_by_kind(
    engine: EngineServer, tiny_llama: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    plot = tmp_path / "cmp.png"
    proc, doc = _bench(
        tiny_llama,
        tmp_path,
        "--compare",
        f"live={engine.base_url}",
        f"dead={dead}",
        "--model",
        "m",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--plot",
        str(plot),
    )
    assert proc.returncode == 1  # one target served nothing
    header = next(line for line in proc.stdout.splitlines() if line.startswith("metric"))
    assert "live" in header and "dead" in header
    live, gone = doc["runs"]
    assert gone["summary"]["errors"] == {"connection": 4} and gone["summary"]["completed"] == 0
    # the engine rejects an unknown model name with an OpenAI error: counted by status
    assert live["summary"]["errors"] == {"http_404": 4} or live["summary"]["completed"] == 4
    assert plot.stat().st_size > 10_000
