"""An outside load generator against `lbd route`: guidellm (from PyPI, its own venv `.venv-loadgen/`,
installed by `bash scripts/setup-peers.sh`) drives the router over a supervised node, once per OpenAI request
format it knows (chat completions, completions, the Responses API), and its JSON report is read back here.

Set-up: `lbd supervise` with --ranks `--device sim` ranks of the model (real front ends, schedulers and
caches, the forward pass a timing model of an H100), `lbd route` in front, then for each format
`guidellm run --backend kind=openai_http,request_format=FORMAT --profile kind=concurrent,streams=C
--constraint kind=max_requests,count=N --data kind=synthetic_text,...`. The table shows what guidellm measured
(requests completed/errored, requests/s, output tok/s, TTFT and ITL p50/p99) next to the router's own count
of the requests it answered with 200, so a format the router or the engine did not speak shows as errors.

    .venv/bin/python benchmarks/outside_loadgen.py [--ranks 2] [--streams 8] [--requests 64]
        [--formats /v1/chat/completions,/v1/completions,/v1/responses] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from peers import lbd_route_argv  # noqa: E402
from support.node import SupervisorNode  # noqa: E402
from support.procs import exit_on_sigterm, free_port, spawn, stop, wait_http  # noqa: E402

GUIDELLM = ROOT / ".venv-loadgen" / "bin" / "guidellm"
FORMATS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def router_ok_count(url: str) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == "lbd_router_requests":
            total += sum(s.value for s in fam.samples
                         if s.name.endswith("_total") and s.labels["status"] == "200")
    return total


def run_guidellm(target: str, model: str, tokenizer: str, fmt: str, streams: int, requests: int,
                 out: Path, log: Path) -> dict:
    argv = [str(GUIDELLM), "run",
            "--backend", f"kind=openai_http,target={target},model={model},request_format={fmt}",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=64",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    with open(log, "wb") as f:
        code = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=1800,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    if code != 0 or not out.exists():
        raise RuntimeError(f"guidellm exited {code}; see {log}")
    return json.loads(out.read_text())["benchmarks"][0]["metrics"]


def summary(m: dict) -> dict[str, float]:
    def pct(key: str, p: str) -> float:
        return m[key]["successful"]["percentiles"][p]

    totals = m["request_totals"]
    return {"ok": totals["successful"], "errors": totals["errored"], "incomplete": totals["incomplete"],
            "rps": m["requests_per_second"]["successful"]["mean"],
            "tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_p50": pct("time_to_first_token_ms", "p50"),
            "ttft_p99": pct("time_to_first_token_ms", "p99"),
            "itl_p50": pct("inter_token_latency_ms", "p50"), "itl_p99": pct("inter_token_latency_ms", "p99")}


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--streams", type=int, default=8, help="guidellm's concurrent streams")
    p.add_argument("--requests", type=int, default=64, help="requests per format")
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args()
    if not GUIDELLM.exists():
        print(f"{GUIDELLM} is missing: run bash scripts/setup-peers.sh", file=sys.stderr)
        return 2
    from lbd.engine.loader import resolve_model

    model_dir = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="lbd-loadgen-"))
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; guidellm "
          + subprocess.run([str(GUIDELLM), "--version"], capture_output=True, text=True).stdout.strip())
    node = SupervisorNode(model_dir, args.ranks, "--served-model-name", "lbd-model", log=tmp / "node.log",
                          engine_flags=["--device", "sim", "--log-level", "warning"])
    router = None
    try:
        node.wait_ready(300)
        port = free_port()
        argv, ready = lbd_route_argv(port, f"supervisor://127.0.0.1:{node.sport}")
        router = spawn(argv, log=tmp / "router.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + ready, 60, router)
        rows = []
        for fmt in [f for f in args.formats.split(",") if f]:
            before = router_ok_count(url)
            m = run_guidellm(url, "lbd-model", model_dir, fmt, args.streams, args.requests,
                             tmp / f"{fmt.strip('/').replace('/', '-')}.json", tmp / "guidellm.log")
            rows.append((fmt, summary(m), router_ok_count(url) - before))
        print(f"\n{args.ranks} sim ranks (h100-llama3-8b timing) behind lbd route; guidellm concurrent@"
              f"{args.streams}, {args.requests} requests per format, 256 prompt / 64 output tokens\n")
        print("| request format | guidellm: ok / errored / incomplete | router 200s | req/s | output tok/s "
              "| TTFT p50 / p99 ms | ITL p50 / p99 ms |")
        print("|---|---|---:|---:|---:|---|---|")
        for fmt, s, routed in rows:
            print(f"| {fmt} | {s['ok']} / {s['errors']} / {s['incomplete']} | {routed:.0f} | "
                  f"{s['rps']:.1f} | {s['tok_s']:.0f} | {s['ttft_p50']:.1f} / {s['ttft_p99']:.1f} | "
                  f"{s['itl_p50']:.1f} / {s['itl_p99']:.1f} |")
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    finally:
        if router is not None:
            stop(router)
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
