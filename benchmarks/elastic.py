"""An elastic fleet under load (issue 46, acceptance 1 and 2): `lbd serve --autoscale 2:8` on ``--device sim``
ranks through a load that steps 1x -> 3x -> 1x, an offline sweep of the same loads at fixed sizes, and
scale-downs of real CPU ranks under the chaos soak's request mix.

**Load steps** (default): `lbd serve --data-parallel-size 2 --autoscale 2:8` with sim ranks
(``h100-llama3-8b*K``: each step takes K times its H100 time, default K = 10, so the shared two-core host
keeps up; 256 MiB of KV a rank = 2,048 tokens, ``--max-num-seqs 16``) and the open-loop load of
``elastic_load.StepLoad``: shorts (a ~160-token prompt, 32 tokens out, Poisson at ``--short-rate`` x level)
and 500-token streams (one every ``--long-every-s`` / level s, evenly, so they run at every scale-down).
The **TTFT SLO is 2.0 s** of wall time (``--slo-s``; the router's default ``--ttft-target-ms``), to be met by
95% of requests. The planner's delays are shortened from their defaults so that the resizes of a day fit in a
few minutes (``--autoscale-*``: interval 1 s, up after 3 s, down after 15 s, cooldown 5 s); scale-downs drain
for 0 s (``--drain-timeout-s``) and give 1 s (``--shutdown-timeout``) before the engine cuts what still runs
with a retryable error, so every stream on a removed rank must move to another rank (the router's resume).
Time is not compressed beyond that: the issue's "10 minutes" is ``--phases`` of wall time (default
1x 120 s, 3x 180 s, 1x 240 s: 9 minutes), on a device dilated K times.

Reported: per phase, requests, SLO attainment, TTFT p50/p95, mean ranks running (and routed), the host's
load average; every resize; per scale-down the streams in flight (500-token ones among them) and the client
errors and cut streams among the requests it overlapped (a stream is cut unless it ends with one [DONE],
one finish_reason, usage = max_tokens and as many words as tokens: ``elastic_load.sim_judge``); per step
up the seconds to the grow decided, its ranks ready, and the router routing to them.

**On CPU ranks** (``--device cpu --autoscale-range 1:2``, with shorter ``--phases`` and lower rates): the same
load steps and sweep on real CPU ranks of the default model (SmolLM2-135M-Instruct; a stream is judged by its
[DONE], finish reason and usage, its tokens not being words), sizes 1..MAX. A node splits its CPUs among the
ranks it starts with and a rank keeps its slice (``lbd.supervisor.scale``), so both the sweep and the load
steps start at MAX ranks and shrink (the steps: the idle planner, before the load): a rank has the CPUs of
one MAX-th of the machine at every size, and a rank added is capacity added, not a share of rank 0's CPUs.

**Sweep** (``--sweep``): the same loads, one level at a time, at fixed sizes 1..MAX (one `lbd serve` resized
with POST /scale between points), ``--sweep-s`` each, counting requests after ``--sweep-warm-s``; per level
the smallest size meeting the SLO (a level starts at the size the level below it needed). The autoscaled
run's mean ranks per level are then set against it (the issue: within 15%).

**Scale-downs under the chaos mix** (``--chaos-scale-downs N``): `lbd supervise` with 2 CPU ranks of a random
8-layer Llama (hidden 512; slow enough that streams run at a scale-down) behind `lbd route --workers 1`, the
chaos soak's open-loop mix (``soak.Load``, ``soak_mix.kinds``: every answer held to the unbroken one's text,
finish reason and token count); N times: wait until the leaving rank has requests in flight, shrink 2 -> 1
(drain 0 s, ``--chaos-shutdown-timeout`` 0 s: what still runs is cut and must be resumed elsewhere), grow back
to 2 and wait until the router routes to it. Reported: sent, lost, broken, wrong (0, 0, 0 is the acceptance),
failures by the resize they followed, streams the router resumed per cycle.

    .venv/bin/python benchmarks/elastic.py [--sweep] [--no-steps] [--chaos-scale-downs 20] [--out DIR]

Exit 1 when an acceptance check fails (printed with the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from elastic_load import Phase, Poller, StepLoad  # noqa: E402
from elastic_report import (  # noqa: E402
    attainment,
    mean_of,
    needed,
    phase_table,
    resizes,
    scale_downs,
    step_ups,
    ttft_quantile,
)
from soak import Load, blame  # noqa: E402
from soak_mix import kinds, reference  # noqa: E402
from support import RouterServer  # noqa: E402
from support.node import SupervisorNode  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402
from support.tiny import make_tiny_llama  # noqa: E402

PY = sys.executable
TOKEN = "elastic-admin-token"  # pragma: allowlist secret (a throwaway for the benchmark's node)


def bounds_of(args: argparse.Namespace) -> tuple[int, int]:
    """--autoscale-range MIN:MAX as numbers."""
    low, _, high = args.autoscale_range.partition(":")
    return int(low), int(high)


class Serve:
    """`lbd serve` with sim ranks (or CPU ranks of the default model: ``--device cpu``) on free loopback
    ports (router, ranks' run of the range's MAX, health port)."""

    def __init__(self, model: Path | None, size: int, args: argparse.Namespace, extra: list[str],
                 log: Path) -> None:
        rank_port, self.port, self.hport = free_port_run(bounds_of(args)[1]), free_port(), free_port()
        self.url, self.health = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self.hport}"
        sim = ["--model", str(model), "--sim-profile", f"h100-llama3-8b*{args.time_scale:g}"]
        device = ["--device", "sim", *sim] if args.device == "sim" else ["--device", "cpu"]  # default model
        argv = [PY, "-m", "lbd", "serve", *device, "--host", "127.0.0.1", "--port",
                str(self.port), "--rank-port", str(rank_port), "--data-parallel-supervisor-port",
                str(self.hport), "--data-parallel-size", str(size), "--max-model-len", "2048",
                "--max-num-seqs", "16", "--kv-cache-memory-bytes", "256MiB", "--shutdown-timeout",
                str(args.shutdown_timeout), "--scale-down-drain-timeout-s", str(args.drain_timeout_s),
                "--log-level", "warning", *extra]
        self.proc = spawn(argv, log=log)

    def model_name(self) -> str:
        """The model the node serves (its /v1/models' first)."""
        return str(httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"])

    def wait_ready(self, size: int, timeout: float = 300.0) -> None:
        wait_http(self.health + "/readyz", timeout, self.proc)
        self.wait_routed(size, timeout)

    def wait_routed(self, size: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            eps = httpx.get(self.url + "/router/status", timeout=10).json()["endpoints"]
            if sum(e["state"] == "ready" for e in eps) == size == len(eps):
                return
            time.sleep(0.3)
        raise TimeoutError(f"the router does not route to exactly {size} ranks")

    def scale(self, size: int, timeout: float = 300.0) -> None:
        """POST /scale and wait until the node has ``size`` ranks and the router routes to them all."""
        r = httpx.post(self.health + "/scale", json={"data_parallel_size_local": size}, timeout=30)
        if r.status_code not in (200, 202):
            raise RuntimeError(f"POST /scale {size}: {r.status_code} {r.text[:300]}")
        deadline = time.monotonic() + timeout
        while (s := httpx.get(self.health + "/status", timeout=10).json()).get("scaling", {}) and \
                s["scaling"]["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.3)
        self.wait_routed(size, max(10.0, deadline - time.monotonic()))

    def close(self) -> None:
        stop(self.proc, timeout=60)


def parse_phases(text: str) -> list[Phase]:
    out = []
    for part in text.split(","):
        level, _, seconds = part.partition(":")
        out.append(Phase(float(level), float(seconds)))
    return out


def step_load(args: argparse.Namespace, url: str, model: str, phases: list[Phase], seed: int) -> StepLoad:
    return StepLoad(url, model, phases, args.short_rate, args.long_every_s, seed=seed,
                    words_are_tokens=args.device == "sim")


def warm(url: str, model: str) -> None:
    body = {"model": model, "prompt": "warm up", "max_tokens": 4}
    for _ in range(4):
        httpx.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()


# ---- acceptance 1: load steps under the built-in planner -------------------------------------------------
def run_steps(args: argparse.Namespace, model: Path | None, out: Path) -> dict:
    phases = parse_phases(args.phases)
    autoscale = ["--autoscale", args.autoscale_range,
                 "--autoscale-interval-s", str(args.autoscale_interval_s),
                 "--autoscale-up-after-s", str(args.autoscale_up_after_s),
                 "--autoscale-down-after-s", str(args.autoscale_down_after_s),
                 "--autoscale-cooldown-s", str(args.autoscale_cooldown_s)]
    if args.autoscale_target_utilization is not None:  # else lbd serve's default (what a user gets)
        autoscale += ["--autoscale-target-utilization", str(args.autoscale_target_utilization)]
    low, high = bounds_of(args)
    # CPU ranks: start at the largest size and let the idle planner shrink the node, so every rank holds the
    # CPU slice of the largest size, as in the sweep (a grown node's first rank would keep every CPU)
    start = high if args.device == "cpu" else low
    serve = Serve(model, start, args, autoscale, out / "steps-serve.log")
    try:
        serve.wait_ready(start)
        serve.wait_routed(low, timeout=120 + 4 * args.autoscale_down_after_s)
        name = serve.model_name()
        warm(serve.url, name)
        t0 = time.monotonic()
        poller = Poller(serve.health, serve.url, t0)
        poller.start()
        load = step_load(args, serve.url, name, phases, seed=1)
        asyncio.run(load.run(t0))
        poller.stop.set()
        poller.join(30)
        migrations = httpx.get(serve.url + "/router/status", timeout=10).json().get("migrations")
    finally:
        serve.close()
    events = resizes(poller)
    recs = load.records
    result = {"phases": phase_table(phases, recs, poller.rows, args.slo_s, settle_s=args.settle_s),
              "attainment": round(100 * (attainment(recs, args.slo_s) or 0), 1), "requests": len(recs),
              "ttft_p50_s": ttft_quantile(recs, 0.5), "ttft_p95_s": ttft_quantile(recs, 0.95),
              "errors": sum(r.outcome == "error" for r in recs), "cut": sum(r.outcome == "cut" for r in recs),
              "failures": sorted({f"{r.outcome}: {r.reason}" for r in recs if r.outcome != "ok"})[:10],
              "resizes": events, "scale_downs": scale_downs(events, recs),
              "step_ups": step_ups(phases, poller.rows, events),
              "migrations": migrations}
    (out / "steps.json").write_text(json.dumps({"result": result, "rows": poller.rows,
                                                "records": [vars(r) for r in recs]}, indent=1))
    return result


# ---- the offline sweep -----------------------------------------------------------------------------------
def run_sweep(args: argparse.Namespace, model: Path | None, out: Path) -> list[dict]:
    levels = sorted({p.level for p in parse_phases(args.phases)})
    serve = Serve(model, 2, args, [], out / "sweep-serve.log")  # a DP deployment; /scale sets the size
    rows: list[dict] = []
    try:
        serve.wait_ready(2)
        name = serve.model_name()
        warm(serve.url, name)
        start = 1
        for level in levels:
            for size in range(start, bounds_of(args)[1] + 1):
                serve.scale(size)
                load = step_load(args, serve.url, name, [Phase(level, args.sweep_s)], seed=100 + size)
                t0 = time.monotonic()
                load1 = os.getloadavg()[0]
                poller = Poller(serve.health, serve.url, t0)  # the router's signals at this fixed size
                poller.start()
                asyncio.run(load.run(t0))
                poller.stop.set()
                poller.join(30)
                counted = [r for r in load.records if r.start >= args.sweep_warm_s]
                att = attainment(counted, args.slo_s)
                row = {"level": level, "size": size, "requests": len(counted),
                       "attainment": None if att is None else round(100 * att, 1),
                       "ttft_p50_s": ttft_quantile(counted, 0.5), "ttft_p95_s": ttft_quantile(counted, 0.95),
                       "errors": sum(r.outcome != "ok" for r in load.records),
                       "saturation": mean_of(poller.rows, "saturation", args.sweep_warm_s, args.sweep_s),
                       "recommended": mean_of(poller.rows, "recommended", args.sweep_warm_s, args.sweep_s),
                       "load1": round((load1 + os.getloadavg()[0]) / 2, 1)}
                rows.append(row)
                print("sweep", row, flush=True)
                if att is not None and 100 * att >= args.target:
                    start = size
                    break
    finally:
        serve.close()
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))
    return rows


# ---- acceptance 2: scale-downs under the chaos soak's mix ------------------------------------------------
class Resizer(threading.Thread):
    """``count`` times: shrink the node 2 -> 1, then grow it back and wait until the router routes to 2."""

    def __init__(self, node: SupervisorNode, router: RouterServer, count: int, t0: float) -> None:
        super().__init__(daemon=True)
        self.node, self.router, self.count, self.t0 = node, router, count, t0
        self.log: list[dict] = []  # the chaos records soak.blame reads: t, action (+ timings)
        self.done = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            for i in range(self.count):
                time.sleep(3.0)  # streams on both ranks again
                self.resize(1, f"scale-down {i + 1}: 2 -> 1")
                self.resize(2, f"grow back {i + 1}: 1 -> 2")
        except Exception as e:  # noqa: BLE001 - reported; the load stops
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.done.set()

    def busy_leaving(self, timeout: float = 15.0) -> int:
        """Waits (up to ``timeout``) until the rank that leaves (the highest) has requests in flight through
        the router (2, or 1 after half the time), so the scale-down has streams to move; returns how many."""
        deadline = time.monotonic() + timeout
        while True:
            eps = self.router.status()["endpoints"]
            inflight = max(eps, key=lambda e: e["rank"] if e["rank"] is not None else -1)["inflight"]
            if inflight >= 2 or (inflight and time.monotonic() >= deadline - timeout / 2) \
                    or time.monotonic() >= deadline:
                return int(inflight)
            time.sleep(0.1)

    def resize(self, size: int, action: str) -> None:
        busy = self.busy_leaving() if size == 1 else None
        began = time.monotonic()
        moved = self.migrations()  # the router counts a move when the resumed stream ends: a cycle's moves
        r = self.node.client.post("/scale", json={"data_parallel_size_local": size},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        if r.status_code != 202:
            raise RuntimeError(f"{action}: POST /scale answered {r.status_code}: {r.text[:300]}")
        self.node.wait_for(lambda: self.node.status()["scaling"]["state"] != "running", 300, action)
        state = self.node.status()["scaling"]
        if state["state"] != "done":
            raise RuntimeError(f"{action}: {state}")
        self.node.wait_for(lambda: sum(e["state"] == "ready" for e in self.router.status()["endpoints"])
                           == size, 120, f"{action}: the router routing to {size}")
        self.log.append({"t": round(began - self.t0, 2), "action": action,
                         "took_s": round(time.monotonic() - began, 1), "resumed_before": moved,
                         "leaving_rank_in_flight": busy})
        print(f"[{began - self.t0:7.1f} s] {action} in {time.monotonic() - began:.1f} s", flush=True)

    def migrations(self) -> int:
        moves = (self.router.status().get("migrations") or {}).get("moves") or {}
        return sum(int(v.get("resumed", 0)) for v in moves.values())  # by reason: {outcome: count}


async def drive(load: Load, done: threading.Event, t0: float) -> None:
    """soak.Load's open loop (its mix, its per-request classification), until the resizes are done."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=load.url, timeout=300, limits=limits) as client:
        tasks, loop = [], asyncio.get_running_loop()
        start = loop.time()
        while not done.is_set():
            stream = load._rng.random() < load.stream_share
            kind = load.mix[load.sent % len(load.mix)]
            tasks.append(asyncio.create_task(load.one(client, kind, stream, t0)))
            load.sent += 1
            await asyncio.sleep(max(0.0, start + load.sent / load.rate - loop.time()))
        await asyncio.gather(*tasks)


def run_chaos(args: argparse.Namespace, out: Path) -> dict:
    model = make_tiny_llama(out / "cpu-model", layers=args.chaos_layers, hidden=512, heads=8, kv_heads=2,
                            intermediate=1024, max_pos=1024)
    port = free_port_run(2)
    node = SupervisorNode(model, 2, "--port", str(port), "--admin-token", TOKEN, "--max-model-len", "1024",
                          "--max-num-seqs", str(args.chaos_max_num_seqs),
                          "--shutdown-timeout", str(args.chaos_shutdown_timeout),
                          "--scale-down-drain-timeout-s", str(args.drain_timeout_s), interval=0.5,
                          timeout=2.0, log=out / "chaos-node.log")
    router = None
    try:
        node.wait_ready(300)
        router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--workers", "1",
                              "--supervisor-poll-interval-s", "0.2", log=out / "chaos-router.log")
        router.wait_ready()
        mix = kinds(args.chaos_max_tokens)
        reference(router.url, str(model), mix)
        load = Load(router.url, str(model), args.chaos_rate, 0.5, mix)
        t0 = time.monotonic()
        load1 = [os.getloadavg()[0]]
        resizer = Resizer(node, router, args.chaos_scale_downs, t0)
        resizer.start()
        asyncio.run(drive(load, resizer.done, t0))
        load1.append(os.getloadavg()[0])
        migrations = router.status().get("migrations")
        resumed = resizer.migrations()
    finally:
        if router is not None:
            router.close()
        node.close()
    o = load.outcomes
    failed: dict[str, int] = {}
    for x in o:
        if x["outcome"] != "ok":
            failed[f"{x['outcome']}: {x['reason']}"] = failed.get(f"{x['outcome']}: {x['reason']}", 0) + 1
    shrinks = [a for a in resizer.log if a["action"].startswith("scale-down")]
    result = {"scale_downs": len(shrinks),
              "resizer_error": resizer.error, "duration_s": round(time.monotonic() - t0, 1),
              "sent": load.sent,
              "completed": sum(x["outcome"] == "ok" for x in o),
              "lost": sum(x["outcome"] == "lost" for x in o),
              "broken": sum(x["outcome"] == "broken_stream" for x in o),
              "wrong": sum(x["outcome"] == "wrong" for x in o), "failed_by_reason": failed,
              "failed_by_resize": blame(o, resizer.log), "migrations": migrations,
              "resumed_per_cycle": [b["resumed_before"] - a["resumed_before"] for a, b in
                                    zip(shrinks, [*shrinks[1:], {"resumed_before": resumed}], strict=True)],
              "leaving_rank_in_flight": [a["leaving_rank_in_flight"] for a in shrinks],
              "resize_s": {"shrink": [a["took_s"] for a in shrinks],
                           "grow": [a["took_s"] for a in resizer.log if a["action"].startswith("grow")]},
              "load1_start_end": load1}
    (out / "chaos.json").write_text(json.dumps({"result": result, "resizes": resizer.log, "outcomes": o},
                                               indent=1))
    return result


# ---- main ------------------------------------------------------------------------------------------------
def verdicts(args: argparse.Namespace, steps: dict | None, sweep: list[dict] | None,
             chaos: dict | None) -> list[str]:
    """The acceptance checks that failed, one line each."""
    bad = []
    if steps is not None:
        if steps["attainment"] < args.target:
            bad.append(f"TTFT-SLO attainment {steps['attainment']}% < {args.target}%")
        for d in steps["scale_downs"]:
            if d["errors"] or d["cut"]:
                bad.append(f"scale-down at {d['at_s']} s: {d['errors']} errors, {d['cut']} cut: "
                           f"{d['reasons']}")
        if sweep:
            need = needed(sweep, args.target)
            for ph in steps["phases"]:
                want = need.get(ph["level"])
                if want is None or ph["ranks_mean"] is None or abs(ph["ranks_mean"] - want) > 0.15 * want:
                    bad.append(f"phase {ph['phase']} ({ph['level']:g}x): mean {ph['ranks_mean']} ranks, the "
                               f"sweep says {want}")
    if chaos is not None:
        if chaos["lost"] or chaos["broken"] or chaos["wrong"] or chaos["resizer_error"]:
            bad.append(f"chaos mix: {chaos['lost']} lost, {chaos['broken']} broken, {chaos['wrong']} wrong, "
                       f"resizer: {chaos['resizer_error']}")
        if chaos["scale_downs"] < args.chaos_scale_downs:
            bad.append(f"chaos mix: {chaos['scale_downs']} of {args.chaos_scale_downs} scale-downs ran")
    return bad


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", action=argparse.BooleanOptionalAction, default=True,
                   help="run the load steps under --autoscale 2:8")
    p.add_argument("--sweep", action="store_true", help="run the offline sweep at fixed sizes 1..8")
    p.add_argument("--chaos-scale-downs", type=int, default=0,
                   help="scale-downs under the chaos mix (0: none)")
    p.add_argument("--phases", default="1:120,3:180,1:240", help="LEVEL:SECONDS,... of the load steps")
    p.add_argument("--device", choices=("sim", "cpu"), default="sim",
                   help="the ranks of the load steps and the sweep: sim ranks of the tiny Llama, or CPU "
                        "ranks of the default model (SmolLM2-135M-Instruct)")
    p.add_argument("--autoscale-range", default="2:8", help="--autoscale MIN:MAX of the load steps; the "
                   "sweep tries sizes 1..MAX")
    p.add_argument("--short-rate", type=float, default=1.5, help="shorts per second at 1x")
    p.add_argument("--long-every-s", type=float, default=15.0, help="a 500-token stream this often at 1x")
    p.add_argument("--time-scale", type=float, default=10.0, help="K of the sim profile h100-llama3-8b*K")
    p.add_argument("--slo-s", type=float, default=2.0, help="the TTFT SLO (wall seconds)")
    p.add_argument("--target", type=float, default=95.0, help="SLO attainment to meet (%%)")
    p.add_argument("--settle-s", type=float, default=60.0, help="a phase's mean ranks 'settled' from here")
    p.add_argument("--autoscale-interval-s", type=float, default=1.0)
    p.add_argument("--autoscale-up-after-s", type=float, default=3.0)
    p.add_argument("--autoscale-down-after-s", type=float, default=15.0)
    p.add_argument("--autoscale-cooldown-s", type=float, default=5.0)
    p.add_argument("--autoscale-target-utilization", type=float, default=None,
                   help="passed to lbd serve when given (0.7: the rule before 8a8bb7f); default: lbd serve's")
    p.add_argument("--drain-timeout-s", type=float, default=0.0, help="--scale-down-drain-timeout-s")
    p.add_argument("--shutdown-timeout", type=float, default=1.0)
    p.add_argument("--sweep-s", type=float, default=60.0, help="seconds of load per sweep point")
    p.add_argument("--sweep-warm-s", type=float, default=20.0, help="a sweep point counts requests from here")
    p.add_argument("--chaos-shutdown-timeout", type=float, default=0.0,
                   help="the CPU ranks' --shutdown-timeout: 0 cuts (to resume) whatever runs past the drain")
    p.add_argument("--chaos-layers", type=int, default=8,
                   help="the CPU ranks' tiny Llama's layers (hidden 512): slow enough that streams run at a "
                        "scale-down")
    p.add_argument("--chaos-max-num-seqs", type=int, default=8,
                   help="the CPU ranks' --max-num-seqs")
    p.add_argument("--chaos-rate", type=float, default=1.5, help="requests per second of the chaos mix")
    p.add_argument("--chaos-max-tokens", type=int, default=128, help="the chaos mix's base answer length")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    exit_on_sigterm()
    out = args.out or Path(tempfile.mkdtemp(prefix="lbd-elastic-"))
    out.mkdir(parents=True, exist_ok=True)
    steps = sweep = chaos = None
    if args.steps or args.sweep:
        model = make_tiny_llama(out / "sim-model", max_pos=2048) if args.device == "sim" else None
        if args.sweep:
            sweep = run_sweep(args, model, out)
            print(json.dumps({"sweep": sweep, "needed": needed(sweep, args.target)}, indent=1), flush=True)
        if args.steps:
            steps = run_steps(args, model, out)
            print(json.dumps({"steps": steps}, indent=1), flush=True)
    if args.chaos_scale_downs:
        chaos = run_chaos(args, out)
        print(json.dumps({"chaos": chaos}, indent=1), flush=True)
    bad = verdicts(args, steps, sweep, chaos)
    print(f"figures in {out}")
    for line in bad:
        print("MISS:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
