"""Soak with chaos: `lbd supervise` (2 ranks) + `lbd route` at a set request rate for a set time, streaming
and not, while a chaos action runs every N seconds: SIGKILL of a rank or of its core alone, SIGSTOP of a rank
or of its core alone, a rolling restart, and a reset of the router's connections to the ranks
(benchmarks/soak_chaos.py). Reports requests sent, completed, failed by reason (lost before any byte vs
broken mid-stream, with what the stream's error event said), failures by the chaos action they followed,
retried and migrated (the router's counters: streams resumed on another rank, with the time from the
failure to the next token, against one prefill of the same prompt on a rank measured at the end of the same
run), the chaos log, and RSS, open FDs and threads of every process over time, with a plot.

    python benchmarks/soak.py --duration-s 600 --chaos-every-s 20 --rate 4 --out /tmp/soak

Exit code 1 when a request was lost before any of its bytes reached the client (the promise), or when the
router's or the supervisor's open FDs or threads grew after warm-up. Chaos acts only while every rank is
ready: taking down the last ready rank would lose requests by construction.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from soak_chaos import Chaos, Sampler, flatness, wait_for  # noqa: E402
from soak_mix import STORY, Kind, judge, kinds, read_stream, read_whole, reference  # noqa: E402
from support import RouterServer, metric_value  # noqa: E402
from support.node import SupervisorNode  # noqa: E402
from support.procs import exit_on_sigterm  # noqa: E402
from support.tiny import make_tiny_llama  # noqa: E402

TOKEN = "soak-admin-token"
PROMPT = STORY


class Load:
    """Open-loop load: a request every 1/rate s whatever the answers, cycling through the mix
    (benchmarks/soak_mix.py); each outcome is classified, and every answer is held to the unbroken one."""

    def __init__(self, url: str, model: str, rate: float, stream_share: float, mix: list[Kind]) -> None:
        self.url, self.model, self.rate = url, model, rate
        self.stream_share, self.mix = stream_share, mix
        self.outcomes: list[dict] = []  # t, kind, stream, outcome, reason, latency
        self.sent = 0
        self._rng = random.Random(7)

    async def run(self, duration_s: float, t0: float) -> None:
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:
            tasks = []
            loop = asyncio.get_running_loop()
            start = loop.time()
            while loop.time() - start < duration_s:
                stream = self._rng.random() < self.stream_share
                kind = self.mix[self.sent % len(self.mix)]
                tasks.append(asyncio.create_task(self.one(client, kind, stream, t0)))
                self.sent += 1
                await asyncio.sleep(max(0.0, start + self.sent / self.rate - loop.time()))
            await asyncio.gather(*tasks)

    async def one(self, client: httpx.AsyncClient, kind: Kind, stream: bool, t0: float) -> None:
        body = kind.request(self.model, stream)
        began = time.monotonic()
        got_bytes = False
        outcome, reason = "ok", ""
        try:
            if stream:
                async with client.stream("POST", kind.path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        outcome, reason = "lost", f"status {r.status_code}: {_message(r.content)}"
                    else:
                        text = ""
                        async for chunk in r.aiter_text():
                            got_bytes = True
                            text += chunk
                        answer = read_stream(kind, text)
                        if answer.errors or answer.dones != 1:
                            outcome, reason = "broken_stream", _stream_error(text)
                        elif (why := judge(kind, answer, True)) is not None:
                            outcome, reason = "wrong", why
            else:
                r = await client.post(kind.path, json=body)
                if r.status_code != 200:
                    outcome, reason = "lost", f"status {r.status_code}: {_message(r.content)}"
                elif (why := judge(kind, read_whole(kind, r.json()), False)) is not None:
                    outcome, reason = "wrong", why
        except httpx.HTTPError as e:
            outcome = "broken_stream" if got_bytes else "lost"
            reason = type(e).__name__
        if outcome != "ok":
            reason = f"{kind.name}: {reason}"
        self.outcomes.append({"t": round(began - t0, 2), "kind": kind.name, "stream": stream,
                              "outcome": outcome, "reason": reason,
                              "latency_s": round(time.monotonic() - began, 3)})


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"][:120]
    except (ValueError, KeyError, TypeError):
        return body[:120].decode("utf-8", "replace")


def _stream_error(text: str) -> str:
    """What an SSE error event says (rank URLs folded), or "cut" for a stream that just stopped."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                message = json.loads(line[6:])["error"]["message"]
            except (ValueError, KeyError, TypeError):
                return "error event"
            return "error event: " + re.sub(r"https?://\S+", "<rank>", str(message))[:100]
    return "cut"


def blame(outcomes: list[dict], chaos: list[dict], within_s: float = 10.0) -> dict[str, int]:
    """Failures by the last chaos action before each one ended (within ``within_s``), else "no chaos"."""
    out: dict[str, int] = {}
    for o in outcomes:
        if o["outcome"] == "ok":
            continue
        end = o["t"] + o["latency_s"]
        before = [c for c in chaos if c["t"] <= end + 0.5 and end - c["t"] <= within_s]
        key = before[-1]["action"] if before else "no chaos action"
        out[key] = out.get(key, 0) + 1
    return out


def summarize(load: Load, chaos: Chaos, sampler: Sampler, router_metrics: str, duration: float,
              warmup_s: float) -> dict:
    by: dict[str, int] = {}
    for o in load.outcomes:
        if o["outcome"] != "ok":
            key = f"{o['outcome']}: {o['reason']}"
            by[key] = by.get(key, 0) + 1
    retried = {}
    for line in router_metrics.splitlines():
        if line.startswith("lbd_router_retries_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            retried[reason] = metric_value(router_metrics, "lbd_router_retries_total", reason=reason)
    ok = [o for o in load.outcomes if o["outcome"] == "ok"]
    lat = sorted(o["latency_s"] for o in ok)
    return {
        "duration_s": round(duration, 1), "warmup_s": warmup_s, "sent": load.sent, "completed": len(ok),
        "lost_before_any_byte": sum(o["outcome"] == "lost" for o in load.outcomes),
        "broken_mid_stream": sum(o["outcome"] == "broken_stream" for o in load.outcomes),
        "wrong": sum(o["outcome"] == "wrong" for o in load.outcomes),
        "failed_by_reason": by, "failed_by_chaos_action": blame(load.outcomes, chaos.done),
        "retried_by_reason": retried,
        "latency_s": {"p50": lat[len(lat) // 2] if lat else None,
                      "p99": lat[int(len(lat) * 0.99)] if lat else None},
        "chaos": chaos.done, "resources": flatness(sampler.rows, warmup_s),
    }


def prefill_s(node: SupervisorNode, model: str, prompt: str, tries: int = 5) -> float:
    """Median time to the first streamed token of ``prompt`` on the ranks directly: one prefill (a prompt
    under one block is never a prefix-cache hit): what a resumed stream's new rank does first."""
    times = []
    for r in node.status()["ranks"]:
        for _ in range(tries):
            body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True}
            t0 = time.monotonic()
            with httpx.stream("POST", r["url"] + "/v1/completions", json=body, timeout=30) as resp:
                next(line for line in resp.iter_lines() if line.startswith("data: {"))
                times.append(time.monotonic() - t0)
    return sorted(times)[len(times) // 2]


def grew(summary: dict) -> list[str]:
    """Long-lived processes whose FDs or threads grew after warm-up (RSS is reported, judged by eye)."""
    out = []
    for role in ("router", "supervisor"):
        r = summary["resources"].get(role)
        if r and (r["fds_last"] > r["fds_first"] + 8 or r["threads_last"] > r["threads_first"] + 2):
            out.append(f"{role}: fds {r['fds_first']} -> {r['fds_last']}, threads {r['threads_first']} -> "
                       f"{r['threads_last']}")
    return out


def plot(summary: dict, load: Load, sampler: Sampler, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    horizon = int(summary["duration_s"]) + 1
    done = [0] * horizon
    for o in load.outcomes:
        if o["outcome"] == "ok" and int(o["t"]) < horizon:
            done[int(o["t"])] += 1
    axes[0].plot(range(horizon), done, lw=0.8, label="completed / s")
    for o in load.outcomes:
        if o["outcome"] != "ok":
            axes[0].plot(o["t"], 0, "x", color="red" if o["outcome"] == "lost" else "orange")
    axes[0].set_ylabel("requests")
    axes[0].legend(loc="upper right")
    for ax, key, label in ((axes[1], "rss_mb", "RSS (MiB)"), (axes[2], "fds", "open FDs"),
                           (axes[3], "threads", "threads")):
        for role in sorted({r["role"] for r in sampler.rows}):
            rows = [r for r in sampler.rows if r["role"] == role]
            ax.plot([r["t"] for r in rows], [r[key] for r in rows], lw=0.8, label=role)
        ax.set_ylabel(label)
    axes[1].legend(loc="upper left", fontsize=7, ncol=3)
    for ax in axes:
        for c in summary["chaos"]:
            ax.axvline(c["t"], color="grey", lw=0.5, ls=":")
    axes[3].set_xlabel("seconds (dotted: chaos actions)")
    fig.suptitle(f"soak: {summary['sent']} sent, {summary['completed']} completed, "
                 f"{summary['lost_before_any_byte']} lost, {summary['broken_mid_stream']} broken mid-stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--chaos-every-s", type=float, default=20.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (open loop)")
    p.add_argument("--stream-share", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=16, help="the mix's base answer length (soak_mix.kinds)")
    p.add_argument("--max-model-len", type=int, default=256,
                   help="the ranks' context: where a chat without max_tokens ends")
    p.add_argument("--pd", action=argparse.BooleanOptionalAction, default=True,
                   help="three ranks, rank 0 prefilling for ranks 1 and 2 (long prompts go P/D), instead of "
                        "two mixed ranks")
    p.add_argument("--model", type=Path, default=None, help="default: a tiny random Llama made here")
    p.add_argument("--out", type=Path, default=None, help="folder for soak.json, soak.png and the logs")
    args = p.parse_args(argv)
    exit_on_sigterm()
    out = args.out or Path(tempfile.mkdtemp(prefix="lbd-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or make_tiny_llama(out / "model", layers=4, hidden=256, heads=4, kv_heads=2,
                                          intermediate=512, max_pos=1024)
    ranks = 3 if args.pd else 2
    roles = ["--prefill-ranks", "0", "--decode-ranks", "1,2"] if args.pd else []
    node = SupervisorNode(model, ranks, *roles, "--max-model-len", str(args.max_model_len),
                          "--admin-token", TOKEN, "--shutdown-timeout", "10",
                          "--health-stall-timeout-s", "3", "--dp-supervisor-probe-generate", "5",
                          "--restart-backoff-initial-s", "0.5", "--restart-backoff-max-s", "5",
                          interval=0.5, timeout=2.0, threshold=2, log=out / "node.log")
    router = None
    try:
        node.wait_ready(300)
        router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--outlier-first-byte-"
                              "timeout-s", "5", *(["--pd-disaggregation", "--pd-min-prompt-tokens", "32"]
                                                   if args.pd else []),
                              log=out / "router.log").wait_ready()
        mix = kinds(args.max_tokens)
        reference(router.url, str(model), mix)
        load = Load(router.url, str(model), args.rate, args.stream_share, mix)
        chaos = Chaos(node, router, TOKEN, ranks)
        sampler = Sampler(node, router, ranks)
        t0 = time.monotonic()
        stop = threading.Event()

        def background() -> None:
            next_chaos = t0 + min(args.chaos_every_s, 10.0)
            while not stop.is_set():
                now = time.monotonic()
                sampler.sample(now - t0)
                if now >= next_chaos and now - t0 < args.duration_s - 5:
                    # every rank ready (and routed) first; not once the load is over: an action then loses
                    # nothing by construction, and the final readiness check could pass before the
                    # supervisor saw it (a late kill failed the run's last prefill, connection refused)
                    if wait_for(chaos.ready, 60) and not stop.is_set():
                        record = chaos.act(time.monotonic() - t0)
                        print(f"[{record['t']:7.1f} s] {record['action']} rank {record['rank']}: "
                              f"{record['detail']}", flush=True)
                    next_chaos = time.monotonic() + args.chaos_every_s
                stop.wait(2.0)

        thread = threading.Thread(target=background, daemon=True)
        thread.start()
        asyncio.run(load.run(args.duration_s, t0))
        stop.set()
        thread.join(120)
        duration = time.monotonic() - t0
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
        summary = summarize(load, chaos, sampler, metrics, duration, warmup_s=min(30.0, duration / 5))
        summary["migrations"] = httpx.get(router.url + "/router/status", timeout=10).json()["migrations"]
        summary["mix"] = {k.name: {"sent": sum(o["kind"] == k.name for o in load.outcomes),
                                   "ok": sum(o["kind"] == k.name and o["outcome"] == "ok"
                                             for o in load.outcomes),
                                   "unbroken_tokens": k.tokens, "finish": k.finish} for k in mix}
        summary["decisions"] = {line.split("{", 1)[1].split("}", 1)[0]:
                                float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                                if line.startswith("lbd_router_decisions_total{")}
        wait_for(chaos.ready, 120)  # the last chaos action may have left a rank restarting
        summary["one_prefill_s"] = round(prefill_s(node, str(model), PROMPT), 4)
        (out / "soak.json").write_text(json.dumps({"summary": summary, "samples": sampler.rows,
                                                   "outcomes": load.outcomes}, indent=1))
        plot(summary, load, sampler, out / "soak.png")
    finally:
        if router is not None:
            router.close()
        node.close()
    print(json.dumps({k: v for k, v in summary.items() if k != "chaos"}, indent=1))
    print(f"figures: {out / 'soak.json'}, plot: {out / 'soak.png'}")
    problems = grew(summary)
    if summary["lost_before_any_byte"] or summary["wrong"] or problems:
        print(f"FAIL: {summary['lost_before_any_byte']} lost before any byte, {summary['wrong']} wrong; "
              f"{problems}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
