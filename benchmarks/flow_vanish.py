"""Held requests whose clients vanish (issue 43, acceptance 4): `lbd route --flow-control on` over a fleet
stand-in rank made to report 99 waiting requests (so every request is held), then rounds of ``--batch``
raw connections that each send a request, wait until the router holds all of them, and close. Printed after
every ``--round`` vanished clients: the router's RSS and the queue gauge (``lbd_router_flow_queued``, all
tenants); the RSS is measured from after a warm-up at the same concurrency (its high-water mark).

    .venv/bin/python benchmarks/flow_vanish.py [--total 10000] [--batch 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from support import RouterServer, metric_value  # noqa: E402
from support.procs import free_port_run, spawn, stop, wait_http  # noqa: E402

BODY = json.dumps({"model": "standin-model", "prompt": "hello " * 50, "max_tokens": 8}).encode()
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"x-gateway-inference-fairness-id: t%d\r\nContent-Length: %d\r\n\r\n")


def held(r: RouterServer) -> float:
    return metric_value(httpx.get(r.url + "/metrics", timeout=10).text, "lbd_router_flow_queued")


async def batch(r: RouterServer, n: int) -> None:
    """``n`` clients send a request each, wait until all are held, and close their connections."""
    go = asyncio.Event()

    async def one(i: int) -> None:
        _, wr = await asyncio.open_connection("127.0.0.1", r.port)
        wr.write(HEAD % (i % 50, len(BODY)) + BODY)
        await wr.drain()
        await go.wait()
        wr.close()

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    for _ in range(600):
        if held(r) >= n:
            break
        await asyncio.sleep(0.1)
    go.set()
    await asyncio.gather(*tasks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--total", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=2_000)
    p.add_argument("--round", type=int, default=10_000, help="print every this many")
    args = p.parse_args()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    base = free_port_run(2)
    standin = str(ROOT / "tests" / "support" / "fleet_standin.py")
    fleet = spawn([sys.executable, standin, "--ranks", "1", "--base-port", str(base), "--control-port",
                   str(base + 1)], log=logs / "flow_vanish-fleet.log")
    wait_http(f"http://127.0.0.1:{base}/health", 30, fleet)
    n = str(args.batch * 2)
    r = RouterServer("--upstreams", f"http://127.0.0.1:{base}", "--workers", "1", "--flow-control", "on",
                     "--flow-max-queued", n, "--flow-max-queued-per-tenant", n, "--kv-events", "off",
                     log=logs / "flow_vanish-router.log")
    try:
        r.wait_ready()
        httpx.post(f"http://127.0.0.1:{base + 1}/standin/0/set", json={"waiting": 99}).raise_for_status()
        time.sleep(0.5)

        def rss() -> int:
            return int(Path(f"/proc/{r.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])

        idle = rss()
        asyncio.run(batch(r, args.batch))  # the warm-up: the high-water mark of this concurrency
        time.sleep(1)
        start, t0, done = rss(), time.monotonic(), 0
        print(f"RSS idle {idle} kB, after a warm-up of {args.batch} held at once {start} kB", flush=True)
        while done < args.total:
            asyncio.run(batch(r, args.batch))
            done += args.batch
            if done % args.round == 0 or done >= args.total:
                time.sleep(1)
                now = rss()
                print(f"{done} vanished ({time.monotonic() - t0:.0f} s): queue gauge {held(r):g}, "
                      f"RSS {now} kB ({(now - start) / start:+.1%}), load {os.getloadavg()[0]:.1f}",
                      flush=True)
    finally:
        r.close()
        stop(fleet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
