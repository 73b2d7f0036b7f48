"""Prefill/decode disaggregation against colocated serving, real lbd engines on this machine's CPUs.

Two deployments of the same model, each two engine ranks (one CPU each, LBD_RANK_CPUS) behind `lbd route`:

* colocated: DP=2, `lbd route --upstreams A,B` (every rank prefills and decodes);
* 1P+1D: `lbd route --prefill P --decode D` (P: kv_producer, D: kv_consumer; prompts under
  --pd-min-prompt-tokens run whole on D).

The workload: ``--chats`` clients in a loop of decode-heavy chats (short prompt, ``--chat-tokens`` out,
streamed), and long prompts (``--long-tokens`` tokens, 16 out) arriving every ``--long-every-s`` seconds,
for ``--duration-s``. Reported per deployment: ITL p50/p99/p99.9 of the chats (gaps between streamed tokens),
TTFT p50/p99 of chats and of long prompts, output tok/s. Prompts are random token ids, fresh per request, so
no prefix cache answers them. Deployments run one after the other, ``--rounds`` times interleaved (A B A B),
medians quoted.

    python benchmarks/pd_disagg.py [--duration-s 40] [--chats 4] [--rounds 1]
    python benchmarks/pd_disagg.py --connectors LbdConnector,NixlConnector   # a 1P+1D row for each
    python benchmarks/pd_disagg.py --transfer   # the transport's share of one pull (ZMQ TCP vs the copies)

``--transfer`` times one pull's parts for a SmolLM2-135M-shaped cache (30 layers, 3 KV heads of 64, fp32):
copying the blocks out of the cache, sending them over loopback ZMQ TCP (ROUTER/DEALER, as the connector
does), and writing them into the other cache. A shared-memory transport would save only the middle part.

Every process started here is stopped before the script exits. The machine is shared: compare the rows of
one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support import RouterServer, make_tiny_llama  # noqa: E402
from support.procs import EngineServer, exit_on_sigterm  # noqa: E402

ENGINE = ("--kv-cache-memory-bytes", "512MiB", "--max-model-len", "4096", "--served-model-name", "m",
          "--log-level", "warning")


def kv(role: str, connector: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": connector, "kv_role": role})]


def start(model: Path, mode: str, logs: Path) -> tuple[list[EngineServer], RouterServer]:
    """``mode``: "colocated DP=2", or "1P+1D" and the connector after a space."""
    pd = mode.startswith("1P+1D")
    connector = mode.split()[-1] if pd else ""
    roles = ("kv_producer", "kv_consumer") if pd else (None, None)
    engines = []
    for cpu, role in enumerate(roles):
        engines.append(EngineServer(model, *ENGINE, *(kv(role, connector) if role else []),
                                    env={"LBD_RANK_CPUS": str(cpu)}, log=logs / f"{mode}-{cpu}.log"))
    urls = [e.base_url for e in engines]
    flags = (["--prefill", urls[0], "--decode", urls[1], "--pd-min-prompt-tokens", "1000"] if pd
             else ["--upstreams", ",".join(urls)])
    router = RouterServer(*flags, "--scrape-interval-ms", "100", log=logs / f"{mode}-route.log").wait_ready()
    return engines, router


async def one(session: aiohttp.ClientSession, url: str, ids: list[int],
              out_tokens: int) -> tuple[float, list[float], int]:
    """(TTFT, gaps between later tokens, tokens) of one streamed completion."""
    body = {"model": "m", "prompt": ids, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return (times[0] - t0 if times else float("nan")), gaps, len(times)


async def workload(url: str, args: argparse.Namespace, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    out: dict[str, list[float]] = {"itl": [], "chat_ttft": [], "long_ttft": [], "tokens": [0.0]}
    stop_at = time.perf_counter() + args.duration_s

    async def chat_loop(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop_at:
            ids = [rng.randrange(10, 300) for _ in range(48)]
            ttft, gaps, n = await one(session, url, ids, args.chat_tokens)
            out["chat_ttft"].append(ttft)
            out["itl"].extend(gaps)
            out["tokens"][0] += n

    async def long_loop(session: aiohttp.ClientSession) -> None:
        tasks = []
        while time.perf_counter() < stop_at - args.long_every_s / 2:
            await asyncio.sleep(args.long_every_s)
            ids = [rng.randrange(10, 300) for _ in range(args.long_tokens)]
            tasks.append(asyncio.create_task(one(session, url, ids, 16)))
        for ttft, _, n in await asyncio.gather(*tasks):
            out["long_ttft"].append(ttft)
            out["tokens"][0] += n

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(chat_loop(session) for _ in range(args.chats)), long_loop(session))
        out["tokens"][0] /= time.perf_counter() - t0
    return out


def transfer_costs(blocks: int = 64, reps: int = 5) -> None:
    """Median ms of the copy out, the loopback ZMQ TCP hop and the copy in, for ``blocks`` blocks."""
    import torch
    import zmq

    from lbd.engine.core.kv_alloc import allocate
    from lbd.engine.kv_transfer.blocks import KVBlockIO
    from lbd.engine.models.kv_spec import KVSpec

    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    src = KVBlockIO(allocate(spec, blocks * 2, torch.device("cpu")))
    dst = KVBlockIO(allocate(spec, blocks * 2, torch.device("cpu")))
    ids = list(range(0, blocks * 2, 2))
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    times: dict[str, list[float]] = {"copy out": [], "zmq tcp hop": [], "copy in": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        data = src.read(ids)
        t1 = time.perf_counter()
        client.send(b"pull")
        ident, _ = server.recv_multipart()
        server.send_multipart([ident, b"h", data], copy=False)
        got = client.recv_multipart()[1]
        t2 = time.perf_counter()
        dst.write(ids, got)
        t3 = time.perf_counter()
        for v, dt in zip(times.values(), (t1 - t0, t2 - t1, t3 - t2), strict=True):
            v.append(dt)
    ctx.destroy(linger=0)
    nixl_read(src, dst, ids, times, reps)
    mb = len(data) / 1e6
    print(f"one pull of {blocks} blocks ({blocks * 16} tokens, {mb:.1f} MB, {spec.bytes_per_token} B/token), "
          f"median of {reps}:")
    for k, v in times.items():
        ms = statistics.median(v) * 1000
        print(f"  {k}: {ms:.1f} ms ({mb / (ms / 1000):.0f} MB/s)")


def nixl_read(src, dst, ids: list[int], times: dict[str, list[float]], reps: int) -> None:
    """NixlConnector's path for the same blocks: a NIXL READ (UCX, in-process agents) out of the producer's
    registered cache into the consumer's staging buffer, then the same copy in."""
    try:
        from lbd.engine.kv_transfer.nixl import NixlSink, NixlSource
        source, sink = NixlSource(src, "bench", True), NixlSink(dst, "bench", True)
    except ImportError as e:
        print(f"  (no NIXL row: {e})")
        return
    remote = source.remote(False)
    times["nixl read (replaces copy out + hop)"], times["copy in (after nixl)"] = [], []
    done = threading.Event()

    def producer_progress() -> None:  # what the producer's block server does while a READ is in flight
        while not done.is_set():
            source.released()
            time.sleep(0.0002)

    threading.Thread(target=producer_progress, daemon=True).start()
    for i in range(reps + 1):  # the first READ sets up the UCX endpoint: not timed
        t0 = time.perf_counter()
        data = sink.read("bench", remote, ids, f"t{i}", 10.0)
        t1 = time.perf_counter()
        dst.write(ids, data)
        t2 = time.perf_counter()
        remote = source.remote(True)
        if i:
            times["nixl read (replaces copy out + hop)"].append(t1 - t0)
            times["copy in (after nixl)"].append(t2 - t1)
    done.set()
    sink.close()
    source.close()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=40.0)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--chat-tokens", type=int, default=96)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-every-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--connectors", default="LbdConnector",
                   help="comma-separated: one 1P+1D row per connector (LbdConnector, NixlConnector)")
    p.add_argument("--transfer", action="store_true", help="only time one pull's parts (see above)")
    args = p.parse_args()
    if args.transfer:
        transfer_costs()
        return 0
    exit_on_sigterm()
    work = Path(tempfile.mkdtemp(prefix="pd-bench-"))
    model = make_tiny_llama(work / "model", layers=4, hidden=512, heads=8, kv_heads=2, max_pos=4096)
    rows: dict[str, list[dict[str, float]]] = {"colocated DP=2": []}
    rows.update({f"1P+1D {c}": [] for c in args.connectors.split(",")})
    for r in range(args.rounds):
        for mode in rows:
            engines, router = start(model, mode, work)
            try:
                res = asyncio.run(workload(router.url, args, seed=r))
            finally:
                router.close()
                for e in engines:
                    e.close()
            rows[mode].append({"itl_p50": pct(res["itl"], 0.5), "itl_p99": pct(res["itl"], 0.99),
                               "itl_p999": pct(res["itl"], 0.999),
                               "chat_ttft_p50": pct(res["chat_ttft"], 0.5),
                               "chat_ttft_p99": pct(res["chat_ttft"], 0.99),
                               "long_ttft_p50": pct(res["long_ttft"], 0.5),
                               "long_ttft_p99": pct(res["long_ttft"], 0.99), "tok_s": res["tokens"][0]})
    cols = ["itl_p50", "itl_p99", "itl_p999", "chat_ttft_p50", "chat_ttft_p99", "long_ttft_p50",
            "long_ttft_p99", "tok_s"]
    print(f"workload: {args.chats} chat streams ({args.chat_tokens} tokens out), a {args.long_tokens}-token "
          f"prompt every {args.long_every_s:g} s, {args.duration_s:g} s, {args.rounds} round(s), medians")
    print("| deployment | ITL p50 ms | ITL p99 ms | ITL p99.9 ms | chat TTFT p50 ms | chat TTFT p99 ms "
          "| long TTFT p50 ms | long TTFT p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, runs in rows.items():
        med = {c: statistics.median(run[c] for run in runs) for c in cols}
        cells = [f"{med[c] * 1000:.1f}" for c in cols[:-1]] + [f"{med['tok_s']:.1f}"]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
