"""One router worker over a fleet: 8 to 1,000 ranks, telemetry pushed against scraped.

The ranks are the fleet stand-in (tests/support/fleet_standin.py: one process standing in for hundreds of
ranks, each with its own HTTP port, its own load stream and the h100-llama3-8b step-time profile). For each
size and each mode a fresh stand-in and a fresh `lbd route` (one worker, `--kv-events off`: the stand-in
publishes no KV events, and an endpoint without them would be asked for its sources every 2 s) start; then:

- idle: the router's CPU over ``--idle-s`` seconds with no traffic, as a share of one core: what telemetry
  costs (scrapes or pushed messages; the /health probes every 5 s are in it too, the same in both modes);
- load: a shared-prefix multi-turn workload (12 system prompts of ~1,500 words, 5 turns) at ``--rate``
  requests/s for ``--load-s`` seconds: the router's own time per request before dispatch (parse, facts,
  decision: ``lbd_router_overhead_seconds``, quantiles interpolated in its buckets), its CPU per second, its
  RSS, and the prefix hit rate against an oracle (one cache holding every block any rank computed);
- the decision alone, in-process (``RouterState.snapshots_for``, ``route``, ``on_dispatch``) over as many
  endpoints, each with a sample, for the same workload's requests: its p50/p99;
- KV events ingested per second on one core: the router's feed (``EventFeed.on_live``: decode, sequence
  check, index update) applying pre-encoded vLLM batches in-process, without the socket (``--kv-ingest``).

    .venv/bin/python benchmarks/fleet_scale.py [--sizes 8,64,256,1000] [--modes pushed,scraped]
        [--idle-s 10] [--load-s 10] [--rate 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from support.procs import free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
STANDIN = ROOT / "tests" / "support" / "fleet_standin.py"
MODEL = "standin-model"
BLOCK_WORDS = 16


# ---- processes ---------------------------------------------------------------------------------------------
def start_fleet(n: int, push: bool, tmp: Path, heartbeat_s: float) -> tuple[object, list[str], str]:
    """The stand-in on a free run of ports (tried again when another program takes one of them first)."""
    for attempt in range(3):
        base, control = free_port_run(n), free_port()
        argv = [PY, str(STANDIN), "--ranks", str(n), "--base-port", str(base), "--control-port",
                str(control), "--heartbeat-s", str(heartbeat_s)] + ([] if push else ["--no-push"])
        proc = spawn(argv, log=tmp / f"fleet-{n}-{attempt}.log")
        urls = [f"http://127.0.0.1:{base + i}" for i in range(n)]
        try:
            wait_http(urls[-1] + "/health", 120, proc)
            return proc, urls, f"http://127.0.0.1:{control}"
        except RuntimeError:
            stop(proc)
    raise RuntimeError(f"the fleet stand-in did not start: {(tmp / f'fleet-{n}-2.log').read_text()[-2000:]}")


def start_router(urls: list[str], push: bool, tmp: Path) -> tuple[object, str]:
    upstreams = tmp / "upstreams.txt"
    upstreams.write_text("\n".join(urls) + "\n")
    port = free_port()
    argv = [PY, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port), "--upstreams-file",
            str(upstreams), "--kv-events", "off", "--log-level", "warning", "--telemetry-push",
            "auto" if push else "off"]
    proc = spawn(argv, log=tmp / "router.log")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/readyz", 120, proc)
    return proc, url


def wait_settled(router: str, n: int, push: bool, timeout: float = 120.0) -> float:
    """Until every endpoint has a sample (and, pushed, follows its stream): seconds taken."""
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        eps = httpx.get(router + "/router/status", timeout=30).json()["endpoints"]
        ok = [e for e in eps if e["scrape_age_s"] is not None
              and (not push or (e.get("telemetry_push") or {}).get("state") == "pushed")]
        if len(ok) == n:
            return time.monotonic() - began
        time.sleep(0.5)
    raise TimeoutError(f"only {len(ok)} of {n} endpoints settled")


# ---- workload ----------------------------------------------------------------------------------------------
def prompts(count: int, seed: int = 0) -> list[str]:
    """Shared-prefix multi-turn: 12 system prompts of ~1,500 words, sessions of 5 turns, interleaved."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    systems = [" ".join(rng.choice(vocab) for _ in range(1500)) for _ in range(12)]
    out, sessions = [], []
    while len(out) < count:
        if len(sessions) < 24:
            sessions.append([rng.randrange(12), "", 0])
        s = sessions[rng.randrange(len(sessions))]
        s[1] += " " + " ".join(rng.choice(vocab) for _ in range(60))
        out.append(systems[s[0]] + s[1])
        s[2] += 1
        if s[2] == 5:
            sessions.remove(s)
    return out


def oracle_hit_rate(texts: list[str]) -> float:
    """The share of prompt words one cache holding every block computed so far would serve."""
    seen: set[bytes] = set()
    hits = total = 0
    for text in texts:
        words = text.split()
        total += len(words)
        h, hit = b"", True
        for i in range(len(words) // BLOCK_WORDS):
            h = hashlib.blake2b(h + " ".join(words[i * BLOCK_WORDS:(i + 1) * BLOCK_WORDS]).encode(),
                                digest_size=8).digest()
            if hit and h in seen:
                hits += BLOCK_WORDS
            else:
                hit = False
            seen.add(h)
    return hits / max(1, total)


async def drive(router: str, texts: list[str], rate: float) -> list[int]:
    statuses: list[int] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as client:
        async def one(text: str) -> None:
            try:
                r = await client.post(router + "/v1/completions",
                                      json={"model": MODEL, "prompt": text, "max_tokens": 16})
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append(0)

        began = time.monotonic()
        tasks = []
        for i, text in enumerate(texts):
            await asyncio.sleep(max(0.0, began + i / rate - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(text)))
        await asyncio.gather(*tasks)
    return statuses


# ---- router numbers ----------------------------------------------------------------------------------------
def overhead_buckets(router: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of lbd_router_overhead_seconds, every policy summed."""
    sums: dict[float, float] = {}
    for line in httpx.get(router + "/metrics", timeout=30).text.splitlines():
        if line.startswith("lbd_router_overhead_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            sums[bound] = sums.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return sorted(sums.items())


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Linear interpolation inside the bucket holding quantile ``q`` (Prometheus' histogram_quantile)."""
    total = buckets[-1][1] if buckets else 0.0
    if total == 0:
        return float("nan")
    rank = q * total
    counts = [c for _, c in buckets]
    i = bisect.bisect_left(counts, rank)
    hi, c_hi = buckets[i]
    lo, c_lo = (buckets[i - 1] if i else (0.0, 0.0))
    if hi == float("inf"):
        return lo
    return lo + (hi - lo) * (rank - c_lo) / max(1e-9, c_hi - c_lo)


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


# ---- KV-event ingest ------------------------------------------------------------------------------------
def kv_ingest_rate(seconds: float = 3.0) -> float:
    """Events/s one core applies through the router's feed (decode, sequence, index), no socket."""
    from lbd.router.kv.feed import EventFeed, Source
    from lbd.router.kv.index import BlockIndex
    from lbd.wire.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

    async def run() -> float:
        index = BlockIndex()
        feed = EventFeed("bench", Source("tcp://127.0.0.1:1", None), index.endpoint())
        feed.stats.state = "live"
        rng = random.Random(0)
        payloads, parent = [], None
        for b in range(2000):
            events: list = []
            for _ in range(16):  # a step: 16 stored blocks, each its own event, and their removal later
                h = rng.getrandbits(63)
                events.append(BlockStored([h], parent, list(range(16)), 16, None, "GPU", None))
                parent = h
            events.append(BlockRemoved([e.block_hashes[0] for e in events[:8]], "GPU"))
            payloads.append(encode_batch(KVEventBatch(float(b), events)))
        n, seq = 0, 0
        began = time.process_time()
        while time.process_time() - began < seconds:
            for p in payloads:
                await feed.on_live(seq, p)
                seq += 1
                n += 17
        return n / (time.process_time() - began)

    return asyncio.run(run())


# ---- the decision alone ------------------------------------------------------------------------------------
def decision_times(n: int, count: int = 3000) -> tuple[float, float]:
    """(p50, p99) ms of CPU time (this thread's: a shared host's preemption left out) of one decision
    in-process, as the router makes it: the snapshots it looks at
    (``RouterState.snapshots_for``: every endpoint up to 64, a sample beyond), ``route`` with the default
    policy, and ``on_dispatch`` (the prefix index update), for shared-prefix requests over ``n`` endpoints."""
    from lbd.policies import RequestFacts, chunk_hashes, route
    from lbd.router.config import parse_args
    from lbd.router.shared import SharedCounters
    from lbd.router.state import RouterState
    from lbd.router.telemetry import Sample

    async def run() -> tuple[float, float]:
        gc.collect()
        gc.freeze()  # as the router does after start-up (lbd.router.app)
        gc.set_threshold(20_000, 50, 100)
        cfg = parse_args(["--upstreams", "http://127.0.0.1:1", "--kv-events", "off"])
        state = RouterState(cfg, SharedCounters(1, 1024))
        rng = random.Random(n)
        for i in range(n):
            ep = state.add(f"http://127.0.0.1:{20000 + i}", "static", i)
            sample = Sample(running=rng.randrange(8), waiting=rng.randrange(3), kv_usage=rng.random(),
                            block_size=16, num_blocks=4096, models={MODEL})
            state.observe(ep, sample, state.loop.time())
        texts = prompts(count, seed=n)
        times = []
        for text in texts:
            facts = RequestFacts(model=MODEL, prefix_hashes=chunk_hashes(text), prompt_tokens=len(text) // 4)
            t0 = time.thread_time()
            d = route(state.policy, facts, state.snapshots_for(facts))
            state.policy.on_dispatch(facts, d.endpoint.key)
            times.append(time.thread_time() - t0)
        times.sort()
        return times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3

    return asyncio.run(run())


# ---- one run -----------------------------------------------------------------------------------------------
def run_one(n: int, push: bool, args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="fleet-") as d:
        tmp = Path(d)
        fleet, urls, control = start_fleet(n, push, tmp, args.heartbeat_s)
        router = None
        try:
            router, router_url = start_router(urls, push, tmp)
            settle = wait_settled(router_url, n, push)
            proc = psutil.Process(router.pid)
            time.sleep(2.0)
            c0, t0 = cpu_s(proc), time.monotonic()
            time.sleep(args.idle_s)
            idle = (cpu_s(proc) - c0) / (time.monotonic() - t0)
            texts = prompts(int(args.rate * args.load_s), seed=n)
            before = overhead_buckets(router_url)
            s0 = httpx.get(control + "/standin/stats", timeout=30).json()
            c0, t0 = cpu_s(proc), time.monotonic()
            statuses = asyncio.run(drive(router_url, texts, args.rate))
            busy = (cpu_s(proc) - c0) / (time.monotonic() - t0)
            after = overhead_buckets(router_url)
            diff = [(b, c - dict(before).get(b, 0.0)) for b, c in after]
            s1 = httpx.get(control + "/standin/stats", timeout=30).json()
            queries = s1["prefix_queries"] - s0["prefix_queries"]
            hits = (s1["prefix_hits"] - s0["prefix_hits"]) / max(1, queries)
            oracle = oracle_hit_rate(texts)
            return {"ranks": n, "mode": "pushed" if push else "scraped", "settle_s": round(settle, 1),
                    "idle_cpu": idle, "load_cpu": busy, "p50_ms": quantile(diff, 0.5) * 1e3,
                    "p99_ms": quantile(diff, 0.99) * 1e3, "rss_mb": proc.memory_info().rss / 2**20,
                    "ok": sum(s == 200 for s in statuses), "sent": len(statuses), "hit_rate": hits,
                    "oracle": oracle}
        finally:
            if router is not None:
                stop(router)
            stop(fleet)


def table(rows: list[dict[str, object]]) -> str:
    head = ("| ranks | telemetry | idle router CPU (% core) | CPU under load (% core) "
            "| decision p50 / p99 (ms) "
            "| router overhead p50 / p99 (ms) | RSS (MiB) | ok/sent | prefix hits (of oracle) |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(f"| {r['ranks']} | {r['mode']} | {100 * r['idle_cpu']:.1f} | {100 * r['load_cpu']:.1f} "
                   f"| {r['decision_p50_ms']:.3f} / {r['decision_p99_ms']:.3f} "
                   f"| {r['p50_ms']:.3f} / {r['p99_ms']:.3f} | {r['rss_mb']:.0f} | {r['ok']}/{r['sent']} "
                   f"| {100 * r['hit_rate']:.1f}% ({100 * r['hit_rate'] / max(1e-9, r['oracle']):.0f}%) |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,256,1000")
    p.add_argument("--modes", default="pushed,scraped")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--load-s", type=float, default=10.0)
    p.add_argument("--rate", type=float, default=40.0)
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--kv-ingest", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for mode in args.modes.split(","):
            row = run_one(n, mode == "pushed", args)
            # the decision alone, timed in this process with nothing of ours running beside it
            row["decision_p50_ms"], row["decision_p99_ms"] = decision_times(n)
            rows.append(row)
            print(row, flush=True)
    print(table(rows))
    if args.kv_ingest:
        rate = kv_ingest_rate()
        print(f"KV events ingested: {rate:,.0f} events/s on one core (EventFeed.on_live, no socket)")
    if args.json is not None:
        import json

        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
