"""Engine priority scheduling (issue 43, acceptance 3): a high-priority request arriving behind a full batch
of low-priority ones, on real CPU ranks of the default model, `--scheduling-policy fcfs` and `priority` side
by side in one run (both ranks up at once, the rounds interleaved).

Each round, on each rank:
  idle      the high request's time to first token on the idle rank (fresh prompts, no prefix-cache hit)
  behind    --low low-priority streams (priority 1) fill every seat (--max-num-seqs = --low); once each has
            its first token, high requests (priority 0, fresh prompts of the same length) arrive one after
            the other (--high-samples, while the low ones still run), and their times to first token are taken
The acceptance: under `priority` the median TTFT behind the batch is at most 2x the median idle TTFT (over all
rounds; each round's ratio is printed too), and every low request, preempted or not, finishes with the text
of the unpreempted run: the fcfs rank's, where nothing is preempted (it has seats for all and a KV cache far
larger than they need). Greedy, ignore_eos. On a shared host the ratio moves with the load (printed).

    .venv/bin/python benchmarks/engine_priority.py             # default model, 32 low requests, 3 rounds
    .venv/bin/python benchmarks/engine_priority.py --model /path/to/tiny --rounds 1 --low 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support import metric_value  # noqa: E402
from support.procs import EngineServer, exit_on_sigterm  # noqa: E402

POLICIES = ("fcfs", "priority")


class Stream:
    """One streamed completion: its text, and when its first token came (monotonic seconds)."""

    def __init__(self) -> None:
        self.text, self.first, self.started = "", 0.0, asyncio.Event()

    async def run(self, session: aiohttp.ClientSession, url: str, body: dict) -> Stream:
        async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {await resp.text()}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                self.text += orjson.loads(line[6:])["choices"][0]["text"]
                if not self.started.is_set():
                    self.first = time.monotonic()
                    self.started.set()
        return self


TOKENS = [1000, 40000]  # ordinary token ids of the default model, away from the specials (--token-range)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKENS) for _ in range(n)]


async def ttft(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    t = time.monotonic()
    s = await Stream().run(session, url, body)
    return s.first - t


async def preemptions(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(url + "/metrics") as r:
        return metric_value(await r.text(), "vllm:num_preemptions_total")


async def one_round(url: str, args: argparse.Namespace, seed: int) -> dict:
    """Idle TTFT, then the high request behind --low streams; the low texts by request index."""
    rng = random.Random(seed)
    high = {"max_tokens": args.high_tokens, "temperature": 0, "ignore_eos": True, "priority": 0}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        idle = [await ttft(session, url, {**high, "prompt": prompt(rng, args.high_prompt)})
                for _ in range(args.idle_samples)]
        lows_rng = random.Random(1000 + seed)  # the same low requests on both ranks
        bodies = [{"prompt": prompt(lows_rng, args.low_prompt), "max_tokens": args.low_tokens,
                   "temperature": 0, "ignore_eos": True, "priority": 1} for _ in range(args.low)]
        before = await preemptions(session, url)
        streams = [Stream() for _ in bodies]
        tasks = [asyncio.create_task(s.run(session, url, b)) for s, b in zip(streams, bodies, strict=True)]
        await asyncio.gather(*(s.started.wait() for s in streams))
        behind = []
        for _ in range(args.high_samples):
            if all(t.done() for t in tasks):
                break
            behind.append(await ttft(session, url, {**high, "prompt": prompt(rng, args.high_prompt)}))
        await asyncio.gather(*tasks)
        return {"idle": idle, "behind": behind, "texts": [s.text for s in streams],
                "preemptions": await preemptions(session, url) - before, "load": os.getloadavg()[0]}


def start(policy: str, args: argparse.Namespace, folder: Path) -> EngineServer:
    flags = ["--scheduling-policy", policy, "--max-num-seqs", str(args.low)]
    return EngineServer(args.model, *flags, log=folder / f"{policy}.log", ready_timeout=600)


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f}" if values else "-"


def report(rows: list[tuple[int, str, dict]], args: argparse.Namespace) -> int:
    print(f"\n| round | policy | idle TTFT p50 (ms) | TTFT behind {args.low}, each (ms) | ratio of p50s | "
          "preemptions | low texts equal to the unpreempted run | load |")
    print("|---:|---|---:|---|---:|---:|---|---:|")
    ok = True
    reference = {r: row["texts"] for r, policy, row in rows if policy == "fcfs"}
    for r, policy, row in rows:
        ratio = statistics.median(row["behind"]) / statistics.median(row["idle"])
        same = sum(a == b for a, b in zip(row["texts"], reference[r], strict=True))
        if policy == "priority":
            ok &= same == args.low and row["preemptions"] > 0
        note = " (the reference)" if policy == "fcfs" else ""
        each = ", ".join(f"{b * 1e3:.0f}" for b in row["behind"])
        print(f"| {r} | {policy} | {ms(row['idle'])} | {each} | {ratio:.2f}x | {row['preemptions']:.0f} | "
              f"{same} of {args.low}{note} | {row['load']:.1f} |")
    for policy in POLICIES:
        idle = [t for _, p, row in rows if p == policy for t in row["idle"]]
        behind = [t for _, p, row in rows if p == policy for t in row["behind"]]
        ratio = statistics.median(behind) / statistics.median(idle)
        print(f"{policy}, all rounds: idle TTFT p50 {ms(idle)} ms, behind p50 {ms(behind)} ms: {ratio:.2f}x")
        ok &= policy != "priority" or ratio <= 2.0
    print(f"acceptance (priority: p50 TTFT behind the batch <= 2x idle, every low text equal): "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


async def run(args: argparse.Namespace, servers: dict[str, EngineServer]) -> list[tuple[int, str, dict]]:
    rows = []
    for r in range(args.rounds):
        for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            row = await one_round(servers[policy].base_url, args, seed=r)
            rows.append((r, policy, row))
            print(f"round {r} {policy}: idle p50 {ms(row['idle'])} ms, behind p50 {ms(row['behind'])} ms, "
                  f"{row['preemptions']:.0f} preemptions, load {row['load']:.1f}", flush=True)
    return rows


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: lbd's default model")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--low", type=int, default=32, help="low-priority requests, and --max-num-seqs")
    p.add_argument("--low-prompt", type=int, default=64)
    p.add_argument("--low-tokens", type=int, default=96)
    p.add_argument("--high-prompt", type=int, default=128)
    p.add_argument("--high-tokens", type=int, default=8)
    p.add_argument("--idle-samples", type=int, default=5)
    p.add_argument("--high-samples", type=int, default=3, help="high requests behind the batch, per round")
    p.add_argument("--token-range", type=int, nargs=2, default=TOKENS, metavar=("LO", "HI"),
                   help="prompt token ids are drawn from [LO, HI): within the model's vocabulary")
    args = p.parse_args()
    TOKENS[:] = args.token_range
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for policy in POLICIES:
                servers[policy] = start(policy, args, Path(tmp))
            rows = asyncio.run(run(args, servers))
        finally:
            for s in servers.values():
                s.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return report(rows, args)


if __name__ == "__main__":
    sys.exit(main())
