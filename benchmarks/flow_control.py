"""Flow control under overload and between tenants (issue 43, acceptance 1 and 2): lbd route with flow
control on and off, sglang-router `cache_aware` and vllm-router `round_robin`, interleaved, on one fleet of 8
sim ranks.

The fleet: `lbd supervise` of 8 `--device sim` ranks (`--sim-profile h100-llama3-8b*<time scale>`, so the
CPU is not the bottleneck; `--max-num-seqs` seats per rank, so an overloaded rank queues; by default
`--scheduling-policy priority`: a more important request preempts a running one, for every target alike).
Its capacity is measured first (closed loop, every seat busy: requests/s). Every request is a streamed chat of
``--prompt-words`` words and ``--output-tokens`` tokens; TTFT is the time to its first content chunk.

1. Overload, per target: the interactive tenant alone at ``--interactive-share`` of capacity (its unloaded
   TTFT), then with a batch tenant pushing the total to ``--overload`` x capacity for ``--seconds``
   (interactive ``priority`` 0, batch 1, tenant header ``x-gateway-inference-fairness-id``). Reported:
   interactive p50/p99 TTFT, loaded p99 over unloaded p99, interactive errors, and batch goodput (output
   tokens of batch requests finished within the window) relative to lbd without flow control.
2. Fairness, lbd on and off: four equal tenants asking 1x, 2x, 4x and 8x a fair share (capacity / 4) for
   ``--seconds``: Jain's index of the tokens each was served in the window; and three tenants of weights
   1:2:4 (API keys with tenant= and weight=), each asking a full capacity: their shares against 1:2:4.

Arrivals are Poisson, open loop; at the window's end arrivals stop, the interactive requests still running
are awaited (within a grace), every other request is cancelled (its client goes away) and the fleet is left
to drain before the next target.

    .venv/bin/python benchmarks/flow_control.py [--sim-seconds 60] [--time-scale 5] [--targets ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from lbd.bench.stats import percentile  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from policy_tail import rank_urls, start_fleet  # noqa: E402
from support.procs import exit_on_sigterm, free_port, spawn, stop, wait_http  # noqa: E402

TENANT = "x-gateway-inference-fairness-id"
TARGETS = "lbd:on,lbd:off,sglang-router:cache_aware,vllm-router:round_robin"


@dataclass
class Outcome:
    tenant: str
    start: float
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    status: int = 0
    error: str = ""


@dataclass
class Load:
    """Who sends what: (tenant, rate per s, priority, API key or None)."""

    streams: list[tuple[str, float, int, str | None]]
    outcomes: list[Outcome] = field(default_factory=list)


async def one(session: aiohttp.ClientSession, url: str, args: argparse.Namespace, tenant: str, priority: int,
              key: str | None, out: Outcome) -> None:
    body = {"model": args.model, "messages": [{"role": "user", "content": _prompt(args.prompt_words)}],
            "max_tokens": args.output_tokens, "min_tokens": args.output_tokens, "stream": True,
            "priority": priority}
    headers = {TENANT: tenant}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:200]
                return
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                if b'"content":"' in line and b'"content":""' not in line:
                    if out.ttft is None:
                        out.ttft = time.monotonic() - out.start
                    out.tokens += 1
            out.end = time.monotonic()
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = repr(e)[:200]


WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma")


def _prompt(words: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(words))


async def drive(url: str, args: argparse.Namespace, load: Load, seconds: float, grace: float) -> float:
    """Poisson arrivals of every stream for ``seconds``; returns the window's start (monotonic)."""
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        t0 = time.monotonic()
        tasks: dict[asyncio.Task[None], str] = {}

        async def arrivals(tenant: str, rate: float, priority: int, key: str | None, seed: int) -> None:
            rng = random.Random(seed)
            at = t0
            while True:
                at += rng.expovariate(rate)
                if at - t0 >= seconds:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                o = Outcome(tenant, time.monotonic())
                load.outcomes.append(o)
                tasks[asyncio.create_task(one(session, url, args, tenant, priority, key, o))] = tenant

        await asyncio.gather(*(arrivals(t, r, p, k, i) for i, (t, r, p, k) in enumerate(load.streams)))
        keep = {"interactive"} if args.keep_interactive else set()
        waiting = [t for t, tenant in tasks.items() if tenant in keep and not t.done()]
        if waiting:
            await asyncio.wait(waiting, timeout=grace)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return t0


def served_tokens(outcomes: list[Outcome], t0: float, seconds: float, tenant: str,
                  args: argparse.Namespace) -> int:
    """Prompt and output tokens of ``tenant``'s requests that finished within the window, after its first
    ``--warmup-s`` (before the backlog forms every tenant is served what it asks)."""
    per = args.prompt_words + args.output_tokens
    return sum(per for o in outcomes
               if o.tenant == tenant and o.end is not None and args.warmup_s <= o.end - t0 <= seconds)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else math.nan


# ---- routers -------------------------------------------------------------------------------------------
class Router:
    def __init__(self, target: str, sup: int, urls: list[str], logs: Path, args: argparse.Namespace,
                 extra: tuple[str, ...] = ()) -> None:
        kind, _, mode = target.partition(":")
        self.port = free_port()
        if kind == "lbd":  # lbd:on (with priority ranks: --flow-engine-preemption), lbd:on-hold, lbd:off
            flags = ["--flow-control", "on" if mode.startswith("on") else mode, *shlex.split(args.flow_args),
                     *extra]
            if mode == "on" and args.scheduling_policy == "priority":
                flags.append("--flow-engine-preemption")
            argv, ready = lbd_route_argv(self.port, f"supervisor://127.0.0.1:{sup}", *flags)
        else:
            argv, ready = peer_argv(kind, self.port, urls, mode)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn(argv, log=logs / f"route-{target.replace(':', '-')}-{int(time.time())}.log")
        self.ready = ready

    def __enter__(self) -> Router:
        wait_http(self.url + self.ready, timeout=60, proc=self.proc)
        time.sleep(1.0)  # (the first pushed load state / health check of every rank)
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.proc)


async def settle(urls: list[str]) -> None:
    """Wait for every rank to be idle (cancelled requests aborted) before the next phase."""
    async with aiohttp.ClientSession() as s:
        for _ in range(120):
            busy = 0.0
            for u in urls:
                async with s.get(u + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                            busy += float(line.rsplit(" ", 1)[1])
            if busy == 0:
                return
            await asyncio.sleep(0.5)


async def capacity(url: str, args: argparse.Namespace) -> float:
    """Requests/s the fleet finishes with every seat busy (closed loop)."""
    n = args.ranks * args.max_num_seqs
    done: list[float] = []
    stop_at = time.monotonic() + args.calibrate_s
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def loop() -> None:
            while time.monotonic() < stop_at:
                o = Outcome("calibrate", time.monotonic())
                await one(session, url, args, "calibrate", 0, None, o)
                if o.end is not None and o.end < stop_at:
                    done.append(o.end)
        await asyncio.gather(*(loop() for _ in range(n)))
    warm = [t for t in done if t >= stop_at - args.calibrate_s * 0.6]
    return len(warm) / (args.calibrate_s * 0.6)


# ---- the scenarios ---------------------------------------------------------------------------------------
def overload(args: argparse.Namespace, cap: float, target: str, sup: int, urls: list[str],
             logs: Path) -> dict:
    inter = args.interactive_share * cap
    batch = (args.overload - args.interactive_share) * cap
    with Router(target, sup, urls, logs, args) as r:
        alone = Load([("interactive", inter, 0, None)])
        asyncio.run(drive(r.url, args, alone, args.baseline_seconds, args.grace))
        asyncio.run(settle(urls))
        both = Load([("interactive", inter, 0, None), ("batch", batch, 1, None)])
        t0 = asyncio.run(drive(r.url, args, both, args.seconds, args.grace))
        flows = flow_rows(r.url) if target.startswith("lbd:") else []
    asyncio.run(settle(urls))
    base = [o.ttft for o in alone.outcomes if o.ttft is not None]
    inter_o = [o for o in both.outcomes if o.tenant == "interactive"]
    loaded = [o.ttft for o in inter_o if o.ttft is not None]
    errors = sum(1 for o in inter_o if o.end is None)
    batch_tokens = sum(o.tokens for o in both.outcomes
                       if o.tenant == "batch" and o.end is not None and o.end - t0 <= args.seconds)
    return {"target": target, "unloaded_p99": percentile(base, 99) * 1000,
            "p50": percentile(loaded, 50) * 1000, "p99": percentile(loaded, 99) * 1000,
            "interactive": len(inter_o), "errors": errors,
            "batch_tokens": batch_tokens, "batch_sent": sum(1 for o in both.outcomes if o.tenant == "batch"),
            "batch_refused": sum(1 for o in both.outcomes if o.tenant == "batch" and o.status in (429, 503)),
            "flows": flows, "load1": os.getloadavg()[0]}


def flow_rows(url: str) -> list[dict]:
    """The router's flow counters (/router/status): how long each tenant's requests were held."""
    with urllib.request.urlopen(url + "/router/status", timeout=10) as r:
        flow = json.loads(r.read()).get("flow", {})
    return [{k: f[k] for k in ("tenant", "priority", "dispatched", "wait_s_mean", "shed")}
            for f in flow.get("flows", [])]


def fairness(args: argparse.Namespace, cap: float, target: str, sup: int, urls: list[str],
             logs: Path) -> dict:
    fair = cap / 4
    equal = Load([(f"t{m}x", m * fair, 0, None) for m in (1, 2, 4, 8)])
    keys = logs / "keys"
    keys.write_text("".join(f"k-w{w} tenant=w{w} weight={w}\n" for w in (1, 2, 4)))
    weighted = Load([(f"w{w}", cap, 0, f"k-w{w}") for w in (1, 2, 4)])
    with Router(target, sup, urls, logs, args) as r:
        t0 = asyncio.run(drive(r.url, args, equal, args.seconds, args.grace))
    asyncio.run(settle(urls))
    with Router(target, sup, urls, logs, args, ("--api-key-file", str(keys))) as r:
        t1 = asyncio.run(drive(r.url, args, weighted, args.seconds, args.grace))
    asyncio.run(settle(urls))
    eq = [served_tokens(equal.outcomes, t0, args.seconds, f"t{m}x", args) for m in (1, 2, 4, 8)]
    wt = [served_tokens(weighted.outcomes, t1, args.seconds, f"w{w}", args) for w in (1, 2, 4)]
    shares = [x / sum(wt) if sum(wt) else math.nan for x in wt]
    return {"target": target, "equal_tokens": eq, "jain": jain([float(x) for x in eq]), "weighted_tokens": wt,
            "weighted_shares": shares, "worst_share_error": max(abs(s / (w / 7) - 1) for s, w in
                                                                 zip(shares, (1, 2, 4), strict=True)),
            "load1": os.getloadavg()[0]}


def report(over: list[dict], fair: list[dict]) -> str:
    lines = ["| target | unloaded p99 ms | loaded p50 / p99 ms | p99 / unloaded p99 | interactive errors | "
             "batch output tokens (vs lbd off) | batch refused | load |", "|---|---|---|---|---|---|---|---|"]
    off = next((r["batch_tokens"] for r in over if r["target"] == "lbd:off"), None)
    for r in over:
        rel = f" ({r['batch_tokens'] / off:.0%})" if off else ""
        lines.append(f"| {r['target']} | {r['unloaded_p99']:.0f} | {r['p50']:.0f} / {r['p99']:.0f} | "
                     f"**{r['p99'] / r['unloaded_p99']:.1f}x** | {r['errors']}/{r['interactive']} | "
                     f"{r['batch_tokens']}{rel} | {r['batch_refused']}/{r['batch_sent']} "
                     f"| {r['load1']:.1f} |")
    if fair:
        lines += ["", "| target | served tokens 1x / 2x / 4x / 8x | Jain | weights 1:2:4 shares | worst "
                  "share error | load |", "|---|---|---|---|---|---|"]
        for r in fair:
            lines.append(f"| {r['target']} | {' / '.join(map(str, r['equal_tokens']))} "
                         f"| **{r['jain']:.3f}** | "
                         f"{' / '.join(f'{s:.2f}' for s in r['weighted_shares'])} | "
                         f"{r['worst_share_error']:.0%} | {r['load1']:.1f} |")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=TARGETS, help="lbd:on (--flow-engine-preemption when the ranks "
                   "run priority scheduling), lbd:on-hold (without it), lbd:off, sglang-router:<policy>, "
                   "vllm-router:<policy>")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8, help="seats per rank")
    p.add_argument("--time-scale", type=float, default=10.0, help="dilation of the sim's time")
    p.add_argument("--model", default="lbd-sim")
    p.add_argument("--prompt-words", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0, help="the loaded window (real s)")
    p.add_argument("--sim-seconds", type=float, default=None,
                   help="the loaded window in simulated s (issue 43 asks 60): sets --seconds to this times "
                        "--time-scale")
    p.add_argument("--baseline-seconds", type=float, default=15.0, help="interactive alone (real s)")
    p.add_argument("--calibrate-s", type=float, default=15.0)
    p.add_argument("--grace", type=float, default=30.0, help="s the interactive requests running at the "
                   "window's end are awaited")
    p.add_argument("--keep-interactive", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--interactive-share", type=float, default=0.5)
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument("--no-fairness", action="store_true")
    p.add_argument("--no-overload", action="store_true")
    p.add_argument("--warmup-s", type=float, default=5.0, help="fairness: the window's first seconds, "
                   "not counted")
    p.add_argument("--fairness-targets", default="lbd:on,lbd:off")
    p.add_argument("--flow-args",
                   default="--flow-max-waiting-per-rank 1 --flow-max-prefill-tokens-per-rank 2048",
                   help="`lbd route` flags of both lbd targets")
    p.add_argument("--scheduling-policy", default="priority", choices=["fcfs", "priority"],
                   help="the ranks' (lbd serve's, as vLLM's): priority lets a more important request preempt")
    p.add_argument("--fleet-args", default="")
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=None)
    args = p.parse_args(argv)
    if args.sim_seconds is not None:
        args.seconds = args.sim_seconds * args.time_scale
    args.fleet_args = (f"--sim-profile h100-llama3-8b*{args.time_scale:g} --served-model-name {args.model} "
                       f"--max-num-seqs {args.max_num_seqs} --scheduling-policy {args.scheduling_policy} "
                       f"{args.fleet_args}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    exit_on_sigterm()
    targets = args.targets.split(",")
    for t in targets:
        if not t.startswith("lbd:") and not peer_installed(t.partition(":")[0]):
            sys.exit(f"{t} is not installed (bash scripts/setup-peers.sh routers)")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="flow_control-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", flush=True)
    fleet, port, sup = start_fleet(args, logs / "fleet.log")
    over: list[dict] = []
    fair: list[dict] = []
    try:
        urls = rank_urls(port, args.ranks)
        with Router("lbd:off", sup, urls, logs, args) as r:
            cap = asyncio.run(capacity(r.url, args))
        asyncio.run(settle(urls))
        print(f"capacity {cap:.2f} requests/s ({args.ranks} ranks x {args.max_num_seqs} seats), windows of "
              f"{args.seconds:g} s real ({args.seconds / args.time_scale:g} s simulated), "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
        for run in range(1, args.runs + 1):
            for target in targets if not args.no_overload else ():
                row = overload(args, cap, target, sup, urls, logs)
                over.append({**row, "run": run})
                print(json.dumps(row), flush=True)
            if not args.no_fairness:
                for target in args.fairness_targets.split(","):
                    row = fairness(args, cap, target, sup, urls, logs)
                    fair.append({**row, "run": run})
                    print(json.dumps(row), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"capacity": cap, "args": vars(args), "overload": over,
                                                   "fairness": fair}))
    finally:
        stop(fleet)
    print(report(over, fair))
    return 0


if __name__ == "__main__":
    sys.exit(main())
