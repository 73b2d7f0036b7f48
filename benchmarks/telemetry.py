"""Telemetry costs: recording vLLM's metric families in the engine, and reading them in the router.

Measures, on this machine, in one process (prometheus-client multiprocess mode, as the engine runs it),
in CPU time (a shared machine's load disturbs it less than wall time), the least of --runs runs:
  (1) the core's metrics cost per engine step: steps of an EngineCore with an instant model runner, with and
      without metrics, 32 requests decoding (steady) and 32 short requests replaced as they finish (churn);
  (2) a front end's cost per finished request (vLLM's per-request histograms);
  (3) rendering /metrics of an engine that exports every family (what each scrape costs the front end);
  (4) the router's parse of that text: the former hand-written line scanner, prometheus_client's parser fed
      only the wanted lines (what lbd.router.telemetry does), and prometheus_client's parser on the whole
      text; with the CPU share each would take at the default scrape interval (100 ms) over 16 endpoints.

    .venv/bin/python benchmarks/telemetry.py [--repeat 2000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

_PROM_DIR = tempfile.mkdtemp(prefix="lbd-telemetry-bench-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = _PROM_DIR  # before prometheus_client is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from lbd.engine.config.args import EngineArgs  # noqa: E402
from lbd.engine.core.engine_core import EngineCore  # noqa: E402
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput  # noqa: E402
from lbd.engine.metrics import CoreMetrics, FrontendMetrics, render  # noqa: E402
from lbd.engine.server.request_metrics import record_finished, record_prompt_done  # noqa: E402
from lbd.router.telemetry import parse_metrics  # noqa: E402
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams  # noqa: E402

SCRAPE_INTERVAL_S = 0.1
ENDPOINTS = 16


class InstantRunner:
    """A model runner that answers at once: what is left of a step is the core's own Python."""

    num_blocks, block_size, max_model_len, vocab_size = 8192, 16, 4096, 1000
    eos_token_id, device, dtype = None, "cuda", "bfloat16"

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        return [SampledToken(s.request.request_id, 7) for s in out.seqs if s.sample]


def _core(metrics: CoreMetrics | None) -> EngineCore:
    args = EngineArgs(max_num_seqs=64, max_num_batched_tokens=8192)
    return EngineCore.from_args(args, "", metrics=metrics, runner=InstantRunner())


def _add(core: EngineCore, rid: str, max_tokens: int) -> None:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    core.add_request(EngineCoreRequest(rid, list(range(1, 101)), sp, None, time.time()))


def step_seconds(metrics: CoreMetrics | None, churn: bool, steps: int) -> float:
    core = _core(metrics)
    n = 0
    for _ in range(32):
        _add(core, f"r{n}", 8 if churn else 10**6)
        n += 1
    core.step()  # the prefills
    t = time.process_time()
    for _ in range(steps):
        for o in core.step():
            if o.finish_reason is not None:
                _add(core, f"r{n}", 8)
                n += 1
    return (time.process_time() - t) / steps


def finished_request_seconds(m: FrontendMetrics, repeat: int) -> float:
    seq = SimpleNamespace(num_tokens=128, prompt_ids=list(range(500)), num_cached=256,
                          timings=(100.0, 100.01, 0), first_core_ts=100.05, last_core_ts=101.3)
    t = time.process_time()
    for _ in range(repeat):
        record_finished(m, seq, 1.4, 128)
        record_prompt_done(m, 1, 128)
    return (time.process_time() - t) / repeat


def old_parse(text: str) -> float:
    """The router's parser before this benchmark: a hand-written scanner of vllm: lines (kept here only as
    the baseline; it summed old and new names alike)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        name = line[:brace] if brace > 0 else line.split(" ", 1)[0]
        if name not in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                        "vllm:cache_config_info"):
            continue
        close = line.rfind("}")
        value_text = line[close + 1:].split()[0] if brace > 0 else line.split()[1]
        labels = {}
        for pair in line[brace + 1:close].split(","):
            k, _, v = pair.partition("=")
            labels[k] = v.strip('"')
        total += float(value_text)
    return total


_FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:cache_config_info")


def full_parse(text: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in _FAMILIES:
            total += sum(s.value for s in family.samples)
    return total


def per_call(fn, arg, repeat: int) -> float:
    fn(arg)
    t = time.process_time()
    for _ in range(repeat):
        fn(arg)
    return (time.process_time() - t) / repeat


def per_scrape(fn, texts: list[str]) -> float:
    """Seconds per call over texts whose gauges and counters change from scrape to scrape, as live ones do."""
    fn(texts[0])
    t = time.process_time()
    for text in texts:
        fn(text)
    return (time.process_time() - t) / len(texts)


def scrapes(text: str, n: int) -> list[str]:
    """``n`` variants of ``text``: every sample of the families the router reads gets a new value."""
    moving = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    lines = text.splitlines()
    out = []
    for k in range(n):
        out.append("\n".join(f"{line.rpartition(' ')[0]} {k + i}.0" if line.startswith(moving) else line
                             for i, line in enumerate(lines)) + "\n")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=2000, help="calls per timed measurement")
    p.add_argument("--steps", type=int, default=3000, help="engine steps per timed run")
    p.add_argument("--runs", type=int, default=5, help="runs per measurement (the least is shown)")
    args = p.parse_args()
    try:
        core_m = CoreMetrics("bench-model", 0)
        fe_m = FrontendMetrics("bench-model", 0, 4096)
        load = os.getloadavg()[0]
        print(f"{os.cpu_count()} cpus, load average {load:.1f}; CPU time, least of {args.runs} runs\n")
        rows = []
        for churn in (False, True):
            bare, metered = [], []
            for _ in range(args.runs):
                bare.append(step_seconds(None, churn, args.steps))
                metered.append(step_seconds(core_m, churn, args.steps))
            b, m = min(bare), min(metered)
            what = "32 short requests replaced as they finish" if churn else "32 requests decoding"
            rows.append((f"(1) core step, {what}", f"{b * 1e6:.1f} us without metrics, {m * 1e6:.1f} us "
                         f"with: +{(m - b) * 1e6:.1f} us per step"))
        fin = min(finished_request_seconds(fe_m, args.repeat) for _ in range(args.runs))
        rows.append(("(2) front end, per finished request", f"{fin * 1e6:.1f} us"))
        text = render().decode()
        calls = max(50, args.repeat // 20)
        rend = min(per_call(lambda _: render(), None, calls) for _ in range(args.runs))
        rows.append(("(3) render /metrics (every family)",
                     f"{rend * 1e3:.2f} ms for {len(text) // 1024} KiB, {len(text.splitlines())} lines"))
        live = scrapes(text, args.repeat)
        assert parse_metrics(live[5]).running == 5.0 + next(
            i for i, line in enumerate(text.splitlines()) if line.startswith("vllm:num_requests_running"))
        for name, fn in (("(4) hand-written scanner (before)", old_parse),
                         ("(4) prometheus_client parser on the wanted lines (lbd now)", parse_metrics),
                         ("(4) prometheus_client parser on the whole text", full_parse)):
            runs = live if fn is not full_parse else live[: max(20, len(live) // 20)]
            sec = min(per_scrape(fn, runs) for _ in range(args.runs))
            share = sec / SCRAPE_INTERVAL_S * ENDPOINTS
            rows.append((name, f"{sec * 1e6:.0f} us per scrape = {100 * share:.2f}% of a core for "
                         f"{ENDPOINTS} endpoints at {SCRAPE_INTERVAL_S * 1000:.0f} ms"))
        width = max(len(r[0]) for r in rows)
        for what, value in rows:
            print(f"{what:<{width}}  {value}")
    finally:
        shutil.rmtree(_PROM_DIR, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
