"""Structured outputs, lbd's engine vs vLLM's CPU build (issue 45, acceptance 3): same model, schema, prompts.

Both servers start with ``--structured-outputs-config.backend xgrammar`` and stay up; then, round after round,
each mode runs on each engine in turn (the order flipped every round), with the other idle. Every request is a
streamed chat completion (temperature 0) of a per-round prompt asking for JSON; the constrained ones carry one
``response_format`` json_schema whose fixed-size array is longer than ``--output-len`` tokens can fill, so
every answer runs to its token limit on both engines. Modes:
  - ``json``: constrained, the same (cached) schema for every request, at each --concurrency level;
  - ``free``: the same prompts unconstrained (ignore_eos, the same token limit): lbd's cost of the mask;
  - ``json+new``: ``json`` at the highest level while a request with a schema never seen before arrives every
    --new-schema-every seconds (its own compile): its ITL p99 against ``json``'s shows whether the compile
    stalls the step loop;
  - ``json+old``: the same side requests with the cached schema (their prefill and decode without a compile),
    so ``json+new`` against ``json+old`` is the compile's own cost.
Printed: per engine and mode, output tok/s (median, min-max over rounds), tokens per answer, TTFT / ITL p50
and p99; the ratios from interleaved round pairs (lbd / vLLM constrained; lbd constrained / lbd free; ITL
p99 with / without new schemas). This host is shared: only the ratios of interleaved rounds mean anything,
and the load average goes with every run.

    .venv/bin/python benchmarks/structured.py                        # 2 rounds, c=1 and 32, lbd and vLLM
    .venv/bin/python benchmarks/structured.py --rounds 3 --engines lbd --profile   # + lbd's step breakdown
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_specs import VLLM_PYTHON, EngineSpec, RunningEngine, vllm_available  # noqa: E402
from benchmarks.engine_vs_vllm import _ms, average_rows, cpu_list  # noqa: E402

from lbd.bench.client import RequestRecord, send  # noqa: E402
from lbd.bench.stats import percentile  # noqa: E402

XGRAMMAR = ["--structured-outputs-config.backend", "xgrammar"]
HEADERS = {"Content-Type": "application/json"}
MODES = ("json", "free", "json+new", "json+old")
TOPICS = ["Paris", "the Moon", "a bicycle", "the Nile", "jazz", "volcanoes", "chess", "bees", "Tokyo",
          "the violin", "glaciers", "coffee", "Mars", "the printing press", "owls", "tea", "Lima", "rain"]


def schema(tag: str = "") -> dict:
    """A report with a title and 16 facts: more tokens than an answer is allowed, so each one runs to its
    limit (a fresh ``tag`` renames a property: a schema the server has never compiled)."""
    fact = {"type": "object", "additionalProperties": False, "required": ["name", "detail"],
            "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 30},
                           "detail": {"type": "string", "minLength": 10, "maxLength": 80}}}
    return {"type": "object", "additionalProperties": False, "required": ["title" + tag, "facts"],
            "properties": {"title" + tag: {"type": "string", "minLength": 5, "maxLength": 60},
                           "facts": {"type": "array", "minItems": 16, "maxItems": 16, "items": fact}}}


def response_format(tag: str = "") -> dict:
    return {"type": "json_schema", "json_schema": {"name": "report", "schema": schema(tag), "strict": True}}


@dataclass(slots=True)
class Run:
    engine: str
    mode: str
    concurrency: int
    round: int
    wall_s: float
    tokens: int
    answers: int
    errors: int
    ttft: list[float]
    itl: list[float]
    load: float
    new_schemas: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


def prompts(n: int, round_: int) -> list[str]:
    return [f"Round {round_}, request {i}: write a report about {TOPICS[i % len(TOPICS)]} as JSON, with a "
            "title and a list of facts." for i in range(n)]


def body(model: str, prompt: str, mode: str, max_tokens: int, tag: str = "") -> dict:
    b = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
         "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if mode == "free":
        b["ignore_eos"] = True
    else:
        b["response_format"] = response_format(tag)
    return b


async def _load(url: str, model: str, texts: list[str], mode: str, max_tokens: int, concurrency: int,
                new_every: float, fresh: bool = True) -> tuple[float, list[RequestRecord], int]:
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=conn) as http:
        async def one(i: int, prompt: str) -> RequestRecord:
            async with sem:
                return await send(http, url + "/v1/chat/completions", body(model, prompt, mode, max_tokens),
                                  HEADERS, RequestRecord(str(i), 0, 0.0), True, 1800.0)

        async def new_schemas(done: asyncio.Event) -> int:
            sent: list[asyncio.Task] = []
            while not done.is_set():
                tag = "_" + uuid.uuid4().hex[:8] if fresh else ""
                b = body(model, "Write a short report as JSON.", "json", 4, tag)
                sent.append(asyncio.create_task(send(http, url + "/v1/chat/completions", b, HEADERS,
                                                     RequestRecord("new", 0, 0.0), True, 600.0)))
                try:
                    await asyncio.wait_for(done.wait(), new_every)
                except TimeoutError:
                    pass
            await asyncio.gather(*sent)
            return len(sent)

        done = asyncio.Event()
        side = asyncio.create_task(new_schemas(done)) if new_every > 0 else None
        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(texts)))
        wall = time.perf_counter() - t0
        done.set()
        return wall, records, (await side) if side else 0


def measure(eng: RunningEngine, mode: str, c: int, n: int, round_: int, max_tokens: int,
            new_every: float) -> Run:
    # new prompts for every run (no prefix-cache hits from an earlier run), the same on every engine
    texts = prompts(n, round_ * 1000 + c * 10 + MODES.index(mode))
    base, _, side = mode.partition("+")
    wall, records, news = asyncio.run(_load(eng.url, eng.model, texts, base, max_tokens, c,
                                            new_every if side else 0.0, side == "new"))
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    if bad:
        print(f"  {eng.spec.name} {mode}: {len(bad)} errors, e.g. {bad[0].error}: {bad[0].error_message}",
              flush=True)
    return Run(eng.spec.name, mode, c, round_, wall, sum(r.output_tokens for r in ok), len(ok), len(bad),
               [r.ttft for r in ok if r.ttft is not None], [x for r in ok for x in r.itl], os.getloadavg()[0],
               news)


# ------------------------------------------------------------------------------------------------ report


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(runs: list[Run]) -> list[str]:
    lines = ["| engine | mode | conc | output tok/s (median, min-max) | tokens / answer | "
             "TTFT p50 / p99 ms | ITL p50 / p99 ms | side requests | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r.engine, r.mode, r.concurrency) for r in runs}, key=lambda k: (k[0], k[2], k[1]))
    for e, m, c in keys:
        rs = [r for r in runs if (r.engine, r.mode, r.concurrency) == (e, m, c)]
        tps = [r.tok_s for r in rs]
        ttft = [_ms(_med([percentile(r.ttft, q) for r in rs])) for q in (50, 99)]
        itl = [_ms(_med([percentile(r.itl, q) for r in rs])) for q in (50, 99)]
        errors = sum(r.errors for r in rs)
        lines.append(
            f"| {e}{f' ({errors} errors)' if errors else ''} | {m} | {c} | {_med(tps):.1f} ({min(tps):.1f}-"
            f"{max(tps):.1f}) | {sum(r.tokens for r in rs) / max(1, sum(r.answers for r in rs)):.0f} | "
            f"{ttft[0]} / {ttft[1]} | {itl[0]} / {itl[1]} | {sum(r.new_schemas for r in rs)} | "
            f"{_med([r.load for r in rs]):.1f} |")
    return lines


def ratios(runs: list[Run]) -> list[str]:
    """Per interleaved round: (A, B) pairs of (engine, mode, conc), tok/s ratio and ITL p99 ratio."""
    def of(e: str, m: str, c: int) -> dict[int, Run]:
        return {r.round: r for r in runs if (r.engine, r.mode, r.concurrency) == (e, m, c)}

    levels = sorted({r.concurrency for r in runs})
    top = max(levels) if levels else 0
    pairs = [(f"lbd json / vllm json, c={c}", ("lbd", "json", c), ("vllm", "json", c)) for c in levels]
    pairs += [(f"lbd json / lbd free, c={top}", ("lbd", "json", top), ("lbd", "free", top))]
    for e in ("lbd", "vllm"):
        pairs += [(f"{e} {a} / {e} {b}, c={top}", (e, a, top), (e, b, top))
                  for a, b in (("json+new", "json"), ("json+old", "json"), ("json+new", "json+old"))]
    lines = ["| A / B | output tok/s ratio (median of round pairs, min-max) | ITL p99 A / B ms (ratio) |",
             "|---|---:|---:|"]
    for label, a, b in pairs:
        ra, rb = of(*a), of(*b)
        both = [(ra[k], rb[k]) for k in ra if k in rb and rb[k].tok_s > 0]
        if not both:
            continue
        q = [x.tok_s / y.tok_s for x, y in both]
        pa = _med([percentile(x.itl, 99) for x, _ in both])
        pb = _med([percentile(y.itl, 99) for _, y in both])
        lines.append(f"| {label} | {_med(q):.2f} ({min(q):.2f}-{max(q):.2f}) | {_ms(pa)} / {_ms(pb)} "
                     f"({pa / pb if pb else float('nan'):.2f}) |")
    return lines


PROFILE_KEYS = ("seqs", "step_ms", "schedule", "prepare", "forward_attention", "forward_linear",
                "forward_other", "lm_head", "sample", "update")


def profile(common: dict, workdir: Path, c: int, n: int, max_tokens: int, rounds: int) -> list[str]:
    """A separate lbd server with --profile-steps: the decode steps' breakdown (ms) of json and free runs at
    concurrency ``c``, alternated ``rounds`` times; the mask's cost is in ``sample`` (build + apply) and the
    matchers' advance in ``update``."""
    from lbd.engine.core.step_profile import parse_line

    spec = EngineSpec("lbd-profile", "lbd", extra=[*XGRAMMAR, "--profile-steps", "8"])
    eng = RunningEngine(spec, log=workdir / "lbd-profile.log", **common)
    rows: dict[str, list[dict[str, str]]] = {"json": [], "free": []}
    try:
        measure(eng, "json", 4, 4, -1, 8, 0.0)
        for rnd in range(rounds):
            for mode in (("json", "free") if rnd % 2 == 0 else ("free", "json")):
                mark = len(eng.log.read_text(errors="replace"))
                measure(eng, mode, c, n, 500 + rnd, max_tokens, 0.0)
                time.sleep(0.5)
                lines = [parse_line(x) for x in eng.log.read_text(errors="replace")[mark:].splitlines()]
                rows[mode] += [d for d in lines if d.get("label") == "core" and d.get("kind") == "decode"]
    finally:
        eng.close()
    out = ["| mode | decode steps | " + " | ".join(PROFILE_KEYS) + " |",
           "|---|" + "---:|" * (1 + len(PROFILE_KEYS))]
    for mode, rs in rows.items():
        a = average_rows(rs, PROFILE_KEYS)
        if a is not None:
            cells = " | ".join(f"{a[k]:.2f}" for k in PROFILE_KEYS)
            out.append(f"| {mode} | {a['steps']:.0f} | {cells} |")
    return out


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="lbd,vllm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--requests", default="4,32", help="requests per run at each --concurrency level")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every measured answer")
    p.add_argument("--new-schema-every", type=float, default=1.0, help="seconds between json+new's schemas")
    p.add_argument("--modes", default="json,free,json+new,json+old")
    p.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2)")
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--lbd-args", default="", help="extra flags of lbd's server (e.g. --profile-steps 16)")
    p.add_argument("--profile", type=int, default=0, metavar="ROUNDS",
                   help="then lbd's decode-step breakdown (--profile-steps) of json vs free at the top "
                        "level, over ROUNDS alternated pairs, on a separate server")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    return p.parse_args(argv)


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return out.stdout.strip() or "?"


def plan(modes: list[str], levels: list[int], engine: str) -> list[tuple[str, int]]:
    """(mode, concurrency) runs of one engine in one round: json at every level, the others at the top."""
    top = max(levels)
    out = [("json", c) for c in levels if "json" in modes]
    out += [(m, top) for m in modes if m != "json" and not (m == "free" and engine != "lbd")]
    return out


def rotated(runs: list[tuple[str, int]], round_: int) -> list[tuple[str, int]]:
    """A round's runs, started one further along each round (no mode always first after the other engine)."""
    k = round_ % len(runs) if runs else 0
    return runs[k:] + runs[:k]


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from lbd.engine.loader import resolve_model
    from support import exit_on_sigterm

    exit_on_sigterm()
    args = parse_args(argv)
    names = [n for n in args.engines.split(",") if n]
    notes: list[str] = []
    why = vllm_available(args.vllm_python)
    if why and "vllm" in names:
        notes.append(f"vLLM skipped: {why}")
        names.remove("vllm")
    levels = [int(c) for c in args.concurrency.split(",")]
    reqs = dict(zip(levels, [int(n) for n in args.requests.split(",")], strict=True))
    modes = args.modes.split(",")
    model = Path(resolve_model(args.model))
    cpus, threads = cpu_list()
    workdir = Path(tempfile.mkdtemp(prefix="lbd-structured-"))
    specs = {"lbd": EngineSpec("lbd", "lbd", extra=[*XGRAMMAR, *args.lbd_args.split()]),
             "vllm": EngineSpec("vllm", "vllm", extra=XGRAMMAR)}
    common = dict(model=model, cpus=cpus, threads=threads, kv_gib=args.kv_gib,
                  max_model_len=args.max_model_len, device="cpu", python=args.vllm_python,
                  ready_timeout=900.0)
    load0, commit = os.getloadavg(), _commit()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  commit {commit}  model {model.name}  cpus {cpus}  engines "
          f"{names}  levels {levels}  requests {reqs}  {args.output_len} tokens out  load {load0[0]:.1f}  "
          f"logs {workdir}", flush=True)
    engines: dict[str, RunningEngine] = {}
    runs: list[Run] = []
    try:
        for n in names:
            engines[n] = RunningEngine(specs[n], log=workdir / f"{n}.log", **common)
            print(f"started {n} in {engines[n].startup_s:.1f} s", flush=True)
        for eng in engines.values():  # warm-up (compiles the schema once)
            measure(eng, "json", 4, 4, -1, 8, 0.0)
            measure(eng, "free", 4, 4, -1, 8, 0.0)
        order = list(engines)
        for rnd in range(args.rounds):
            for n in (order if rnd % 2 == 0 else order[::-1]):
                for mode, c in rotated(plan(modes, levels, n), rnd):
                    run = measure(engines[n], mode, c, reqs[c], rnd, args.output_len, args.new_schema_every)
                    runs.append(run)
                    print(f"round {rnd} {n:<5} {mode:<9} c={c:<3} {run.tok_s:6.1f} tok/s  "
                          f"{run.tokens / max(1, run.answers):.0f} tok/answer  ITL p50 "
                          f"{_ms(percentile(run.itl, 50))} p99 {_ms(percentile(run.itl, 99))} ms  "
                          f"side requests {run.new_schemas}  load {run.load:.1f}", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    load1 = os.getloadavg()
    print(f"\n## Structured outputs, lbd vs vLLM (xgrammar): `benchmarks/structured.py`, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, commit {commit}\n")
    print(f"{model.name}, fp32, {threads} CPUs ({cpus}), {args.rounds} rounds, levels {levels} ({reqs} "
          f"requests), {args.output_len} tokens per answer; load average {load0[0]:.1f} at the start, "
          f"{load1[0]:.1f} at the end")
    for line in notes:
        print(f"- {line}")
    print()
    print("\n".join(table(runs)))
    print()
    print("\n".join(ratios(runs)))
    if args.profile:
        top = max(levels)
        print(f"\nlbd's decode steps at c={top}, ms per step (--profile-steps 8, a separate server, "
              f"{args.profile} alternated json/free pairs, load {os.getloadavg()[0]:.1f}):\n")
        print("\n".join(profile(common, workdir, top, reqs[top], args.output_len, args.profile)))
    if args.json:
        args.json.write_text(json.dumps([{k: getattr(r, k) for k in Run.__slots__ if k not in ("ttft", "itl")}
                                         | {"itl_p99": percentile(r.itl, 99)} for r in runs], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
