"""Prefill/decode disaggregation at fleet scale: 8 simulated H100 ranks, colocated against 2P+6D and 4P+4D.

Each deployment is a fresh `lbd supervise` of 8 `--device sim` ranks (real front ends, schedulers, KV-cache
managers and prefix caches; the forward pass is the h100-llama3-8b timing model and a KV pull waits the
modelled time of the blocks the decode rank lacks over the profile's link, ``lbd.engine.kv_transfer.sim``),
time dilated ``--time-scale`` times so two CPU cores are never the bottleneck, behind `lbd route`:

* colocated: `lbd route --upstreams` over all 8 ranks;
* 2P+6D / 4P+4D: `lbd supervise --prefill-ranks/--decode-ranks` (each rank's --kv-transfer-config) and
  `lbd route --prefill URL... --decode URL...`; prompts under ``--pd-min-prompt-tokens`` run whole on a
  decode rank (conditional disaggregation).

The workload (simulated time): ``--chats`` clients in a loop of decode-heavy chats (``--chat-prompt`` tokens
in, ``--chat-tokens`` out, streamed) and long prompts (``--long-tokens`` tokens, 16 out, streamed) arriving
``--long-rate`` per second (Poisson), for ``--duration-s``. Reported per deployment, in simulated H100 time
(measured latencies divided by the time scale): ITL p50/p99 of the chats, TTFT p50/p99 of chats and of long
prompts, output tok/s, and the mean modelled KV pull. Prompts are random token ids (the same seeded sequence
for every deployment), fresh per request, so no prefix cache answers them. Deployments run one after the
other, ``--rounds`` times interleaved (A B C A B C), medians quoted.

    python benchmarks/pd_fleet.py [--duration-s 3] [--time-scale 40] [--rounds 1]

Every process started here is stopped before the script exits. Compare the rows of one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from pd_disagg import one, pct  # noqa: E402
from support import make_tiny_llama  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
DEPLOYMENTS = {"colocated x8": (0, 0), "2P+6D": (2, 6), "4P+4D": (4, 4)}
COLS = ["itl_p50", "itl_p99", "chat_ttft_p50", "chat_ttft_p99", "long_ttft_p50", "long_ttft_p99"]
EXTRA = ["tok_s", "pull_ms", "pull_blocks"]


def start(args: argparse.Namespace, model: Path, prefill: int, logs: Path,
          tag: str) -> tuple[list, list[str]]:
    """The fleet (`lbd supervise`, roles when ``prefill``) and its router; (processes, [router url])."""
    base, sup, port = free_port_run(args.ranks), free_port(), free_port()
    roles = []
    if prefill:
        roles = ["--prefill-ranks", ",".join(map(str, range(prefill))),
                 "--decode-ranks", ",".join(map(str, range(prefill, args.ranks)))]
    fleet = spawn([PY, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
                   "--data-parallel-size", str(args.ranks), "--data-parallel-size-local", str(args.ranks),
                   "--host", "127.0.0.1", "--port", str(base), "--data-parallel-supervisor-port", str(sup),
                   "--device", "sim", "--sim-profile", f"{args.sim_profile}*{args.time_scale:g}",
                   "--model", str(model), "--served-model-name", "m", "--max-model-len", "8192",
                   "--log-level", "warning", "--disable-log-requests", *roles], log=logs / f"{tag}-fleet.log")
    procs = [fleet]
    try:
        wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=300, proc=fleet)
        urls = [f"http://127.0.0.1:{base + i}" for i in range(args.ranks)]
        flags = ["--upstreams", ",".join(urls)]
        if prefill:
            flags = [x for u in urls[:prefill] for x in ("--prefill", u)]
            flags += [x for u in urls[prefill:] for x in ("--decode", u)]
            flags += ["--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)]
        router = spawn([PY, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                        "warning", "--scrape-interval-ms", "100", *flags], log=logs / f"{tag}-route.log")
        procs.append(router)
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120, proc=router)
    except BaseException:  # SIGTERM arrives as SystemExit (exit_on_sigterm): nothing left behind
        for p in reversed(procs):
            stop(p)
        raise
    return procs, [f"http://127.0.0.1:{port}", *urls]


async def workload(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Latencies in real seconds; tokens per real second in ``tokens``."""
    out: dict[str, list[float]] = {"itl": [], "chat_ttft": [], "long_ttft": [], "tokens": [0.0]}
    scale = args.time_scale
    stop_at = time.perf_counter() + args.duration_s * scale

    async def chat_loop(session: aiohttp.ClientSession, i: int) -> None:
        rng = random.Random(1000 + i)
        while time.perf_counter() < stop_at:
            ids = [rng.randrange(10, 300) for _ in range(args.chat_prompt)]
            ttft, gaps, n = await one(session, url, ids, args.chat_tokens)
            out["chat_ttft"].append(ttft)
            out["itl"].extend(gaps)
            out["tokens"][0] += n

    async def long_loop(session: aiohttp.ClientSession) -> None:
        rng, tasks = random.Random(7), []
        while True:
            await asyncio.sleep(rng.expovariate(args.long_rate) * scale)
            if time.perf_counter() >= stop_at:
                break
            ids = [rng.randrange(10, 300) for _ in range(args.long_tokens)]
            tasks.append(asyncio.create_task(one(session, url, ids, 16)))
        for ttft, _, n in await asyncio.gather(*tasks):
            out["long_ttft"].append(ttft)
            out["tokens"][0] += n

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(chat_loop(s, i) for i in range(args.chats)), long_loop(s))
        out["tokens"][0] /= time.perf_counter() - t0
    return out


def pulls(urls: list[str]) -> tuple[float, float, float]:
    """Blocks pulled, pulls, seconds pulling: summed over the ranks' /metrics."""
    blocks = count = seconds = 0.0
    for u in urls:
        for line in httpx.get(u + "/metrics", timeout=10).text.splitlines():
            if line.startswith('lbd:kv_transfer_blocks_total{') and 'direction="pulled"' in line:
                blocks += float(line.rsplit(" ", 1)[1])
            elif line.startswith("lbd:kv_transfer_pull_seconds_count{"):
                count += float(line.rsplit(" ", 1)[1])
            elif line.startswith("lbd:kv_transfer_pull_seconds_sum{"):
                seconds += float(line.rsplit(" ", 1)[1])
    return blocks, count, seconds


def run_one(args: argparse.Namespace, model: Path, name: str, logs: Path, r: int) -> dict[str, float]:
    prefill, _ = DEPLOYMENTS[name]
    procs, (router, *ranks) = start(args, model, prefill, logs, f"{name.replace(' ', '')}-{r}")
    try:
        res = asyncio.run(workload(router, args))
        blocks, count, seconds = pulls(ranks)
    finally:
        for p in reversed(procs):
            stop(p)
    s = args.time_scale
    row = {"itl_p50": pct(res["itl"], 0.5), "itl_p99": pct(res["itl"], 0.99),
           "chat_ttft_p50": pct(res["chat_ttft"], 0.5), "chat_ttft_p99": pct(res["chat_ttft"], 0.99),
           "long_ttft_p50": pct(res["long_ttft"], 0.5), "long_ttft_p99": pct(res["long_ttft"], 0.99)}
    row = {k: v / s for k, v in row.items()}
    row["tok_s"] = res["tokens"][0] * s
    row["pull_ms"] = seconds / count / s * 1000 if count else float("nan")
    row["pull_blocks"] = blocks / count if count else float("nan")
    row["longs"] = len(res["long_ttft"])
    print(f"  round {r} {name}: " + json.dumps({k: round(v, 4) for k, v in row.items()}), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=40.0, help="dilation of simulated time")
    p.add_argument("--duration-s", type=float, default=3.0, help="simulated seconds per deployment")
    p.add_argument("--chats", type=int, default=48)
    p.add_argument("--chat-prompt", type=int, default=128)
    p.add_argument("--chat-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--long-rate", type=float, default=12.0, help="long prompts per simulated second")
    p.add_argument("--pd-min-prompt-tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--only", default=None, help="comma-separated deployments")
    args = p.parse_args()
    exit_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="pd-fleet-"))
    model = make_tiny_llama(work / "model", max_pos=8192)
    names = args.only.split(",") if args.only else list(DEPLOYMENTS)
    rows: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            rows[name].append(run_one(args, model, name, work, r))
    print(f"\nworkload ({args.sim_profile}, time scale {args.time_scale:g}, simulated time): {args.chats} "
          f"chat streams ({args.chat_prompt} tokens in, {args.chat_tokens} out), {args.long_tokens}-token "
          f"prompts (16 out) at {args.long_rate:g}/s Poisson, {args.duration_s:g} s, {args.rounds} round(s), "
          f"medians; logs in {work}")
    print("| deployment | ITL p50 ms | ITL p99 ms | chat TTFT p50 ms | chat TTFT p99 ms | long TTFT p50 ms "
          "| long TTFT p99 ms | output tok/s | mean pull ms (blocks) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, runs in rows.items():
        med = {c: statistics.median(run[c] for run in runs) for c in [*COLS, *EXTRA]}
        cells = [f"{med[c] * 1000:.1f}" for c in COLS] + [f"{med['tok_s']:.0f}"]
        pull = f"{med['pull_ms']:.1f} ({med['pull_blocks']:.0f})"
        cells.append("-" if med["pull_ms"] != med["pull_ms"] else pull)
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
