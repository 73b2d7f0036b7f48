"""lbd's engine vs vLLM's, side by side: same model folder, prompts, output lengths and CPUs, in one run.

Every engine starts first and stays up (warm) for the whole run; then, round after round, each concurrency
level runs on each engine in turn (A B A B ..., the order flipped every round) with the other engines idle, so
only one engine is under load at a time. Each run sends N completions of ~125-token prompts for 128 output
tokens (ignore_eos, temperature 0, streamed) with C in flight, through lbd's own bench client
(``lbd.bench.client``). Every round draws new prompts (no prefix-cache hits across rounds; both engines get
the same ones). Printed:
  - start-up time (spawn -> first answer) of each engine;
  - a greedy check: both engines' texts for a few prompts must agree (so neither wins by computing something
    else); a near-tie fork late in a text is reported, not hidden;
  - per engine and concurrency: output tok/s (median and min-max over rounds), TTFT and ITL p50/p99 (median
    over rounds), and each engine's front-end CPU (cores busy, share of the server's CPU, CPU us per token);
  - lbd/vLLM ratios of output tok/s per round pair (median, min-max): this host's speed drifts, so only
    ratios from interleaved rounds mean anything; the load average is printed with every run;
  - with --profile, lbd's step breakdown (``--profile-steps``) on the same workload, in a separate server.

    .venv/bin/python benchmarks/engine_vs_vllm.py                              # fp32 lbd vs vLLM, 3 rounds
    .venv/bin/python benchmarks/engine_vs_vllm.py --engines all --profile      # + bf16 rows, api-server 2
    .venv/bin/python benchmarks/engine_vs_vllm.py --rounds 1 --concurrency 8,64 --engines lbd,vllm
    .venv/bin/python benchmarks/engine_vs_vllm.py --device cuda                # a GPU: see engine_cuda.py

Engines (--engines, comma list or "all"): lbd, vllm (fp32); lbd-bf16, vllm-bf16 (--dtype bfloat16); lbd-api2
(fp32, --api-server-count 2); lbd-base (fp32, the source tree of --lbd-base-src: before/after a change). vLLM
comes from `bash scripts/setup-peers.sh vllm` (.venv-vllm/); without it the vLLM rows are skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_specs import (  # noqa: E402
    VLLM_PYTHON,
    EngineSpec,
    RunningEngine,
    cpu_seconds,
    vllm_available,
)

from lbd.bench.client import RequestRecord, send  # noqa: E402
from lbd.bench.stats import percentile  # noqa: E402

ENGINES = {
    "lbd": EngineSpec("lbd", "lbd"),
    "vllm": EngineSpec("vllm", "vllm"),
    "lbd-bf16": EngineSpec("lbd-bf16", "lbd", "bfloat16"),
    "vllm-bf16": EngineSpec("vllm-bf16", "vllm", "bfloat16"),
    "lbd-api2": EngineSpec("lbd-api2", "lbd", extra=["--api-server-count", "2"]),
}
PAIRS = [("lbd", "vllm"), ("lbd-bf16", "vllm-bf16"), ("lbd-api2", "vllm"), ("lbd-bf16", "lbd"),
         ("lbd", "lbd-base"), ("lbd-base", "vllm")]
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
                  "The three primary colors are", "Water boils at a temperature of"]
HEADERS = {"Content-Type": "application/json"}


@dataclass(slots=True)
class Run:
    engine: str
    concurrency: int
    round: int
    wall_s: float
    tokens: int
    errors: int
    ttft: list[float]
    itl: list[float]
    fe_cpu_s: float
    engine_cpu_s: float
    load: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(slots=True)
class Workload:
    input_len: int = 125
    output_len: int = 128
    vocab: int = 49152
    seed: int = 0

    def prompts(self, n: int, round_: int, concurrency: int) -> list[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + round_ * 1009 + concurrency)
        lo, hi = 100, min(self.vocab, 40000)  # ordinary tokens, away from the special ones
        return [[rng.randrange(lo, hi) for _ in range(self.input_len)] for _ in range(n)]


# ------------------------------------------------------------------------------------------------ load


async def _load(url: str, model: str, prompts: list[list[int]], output_len: int,
                concurrency: int) -> tuple[float, list[RequestRecord]]:
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=conn) as http:
        async def one(i: int, prompt: list[int]) -> RequestRecord:
            async with sem:
                body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                return await send(http, url + "/v1/completions", body, HEADERS, RequestRecord(str(i), 0, 0.0),
                                  False, 1800.0)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - t0, records


def measure(eng: RunningEngine, prompts: list[list[int]], output_len: int, concurrency: int,
            round_: int) -> Run:
    front, engine = eng.processes()
    fe0, en0 = cpu_seconds(front), cpu_seconds(engine)
    wall, records = asyncio.run(_load(eng.url, eng.model, prompts, output_len, concurrency))
    fe1, en1 = cpu_seconds(front), cpu_seconds(engine)
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    if bad:
        print(f"  {eng.spec.name}: {len(bad)} errors, e.g. {bad[0].error}: {bad[0].error_message}",
              flush=True)
    return Run(eng.spec.name, concurrency, round_, wall, sum(r.output_tokens for r in ok), len(bad),
               [r.ttft for r in ok if r.ttft is not None], [x for r in ok for x in r.itl], fe1 - fe0,
               en1 - en0, os.getloadavg()[0])


def greedy_texts(eng: RunningEngine, max_tokens: int) -> list[str]:
    import httpx

    out = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": eng.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        r = httpx.post(eng.url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def compare_texts(a: list[str], b: list[str]) -> tuple[int, list[str]]:
    """(prompts whose texts are equal, notes on the others: where they fork)."""
    same, notes = 0, []
    for prompt, x, y in zip(GREEDY_PROMPTS, a, b, strict=True):
        if x == y:
            same += 1
            continue
        n = next((i for i, (c, d) in enumerate(zip(x, y, strict=False)) if c != d), min(len(x), len(y)))
        notes.append(f"{prompt!r}: fork after {n} of {len(x)} chars: {x[n:n + 24]!r} vs {y[n:n + 24]!r}")
    return same, notes


# ------------------------------------------------------------------------------------------------ report


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


@dataclass(slots=True)
class Report:
    runs: list[Run] = field(default_factory=list)
    startup: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def of(self, engine: str, c: int) -> list[Run]:
        return [r for r in self.runs if r.engine == engine and r.concurrency == c]

    def table(self, engines: list[str], levels: list[int]) -> list[str]:
        lines = ["| engine | conc | output tok/s (median, min-max) | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
                 "front-end cores | front-end share of CPU | front-end CPU us/token | load |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in engines:
            for c in levels:
                rs = self.of(e, c)
                if not rs:
                    continue
                tps = [r.tok_s for r in rs]
                ttft = [(percentile(r.ttft, 50), percentile(r.ttft, 99)) for r in rs]
                itl = [(percentile(r.itl, 50), percentile(r.itl, 99)) for r in rs]
                fe_cores = _med([r.fe_cpu_s / r.wall_s for r in rs])
                share = _med([r.fe_cpu_s / max(1e-9, r.fe_cpu_s + r.engine_cpu_s) for r in rs])
                us_tok = _med([r.fe_cpu_s / max(1, r.tokens) * 1e6 for r in rs])
                errors = sum(r.errors for r in rs)
                lines.append(
                    f"| {e}{' (' + str(errors) + ' errors)' if errors else ''} | {c} | {_med(tps):.1f} "
                    f"({min(tps):.1f}-{max(tps):.1f}) | {_ms(_med([t[0] for t in ttft]))} / "
                    f"{_ms(_med([t[1] for t in ttft]))} | {_ms(_med([t[0] for t in itl]))} / "
                    f"{_ms(_med([t[1] for t in itl]))} | {fe_cores:.2f} | {100 * share:.0f}% | "
                    f"{us_tok:.0f} | {_med([r.load for r in rs]):.1f} |")
        return lines

    def ratios(self, engines: list[str], levels: list[int]) -> list[str]:
        lines = ["| A / B | conc | output tok/s ratio (median of round pairs, min-max) | ITL p99 A / B ms |",
                 "|---|---:|---:|---:|"]
        best: dict[str, float] = {}
        for a, b in PAIRS:
            if a not in engines or b not in engines:
                continue
            for c in levels:
                ra, rb = self.of(a, c), self.of(b, c)
                pairs = [(x, y) for x in ra for y in rb if x.round == y.round and y.tok_s > 0]
                if not pairs:
                    continue
                q = [x.tok_s / y.tok_s for x, y in pairs]
                p99a = _med([percentile(x.itl, 99) for x, _ in pairs])
                p99b = _med([percentile(y.itl, 99) for _, y in pairs])
                lines.append(f"| {a} / {b} | {c} | {_med(q):.2f} ({min(q):.2f}-{max(q):.2f}) | "
                             f"{_ms(p99a)} / {_ms(p99b)} |")
        for e in engines:
            meds = [_med([r.tok_s for r in self.of(e, c)]) for c in levels if self.of(e, c)]
            if meds:
                best[e] = max(meds)
        for a, b in PAIRS:
            if a in best and b in best and best[b] > 0:
                lines.append(f"| best point {a} / best point {b} | - | {best[a] / best[b]:.2f} "
                             f"({best[a]:.1f} / {best[b]:.1f} tok/s) | |")
        return lines


# ------------------------------------------------------------------------------------------------ profile


def profile_level(eng: RunningEngine, workload: Workload, c: int,
                  n: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Run one level on a server started with --profile-steps; its (core, front-end) profile lines."""
    from lbd.engine.core.step_profile import parse_line

    mark = len(eng.log.read_text(errors="replace"))
    measure(eng, workload.prompts(n, 10_000 + c, c), workload.output_len, c, -1)
    time.sleep(0.5)  # the last window's lines
    lines = [parse_line(x) for x in eng.log.read_text(errors="replace")[mark:].splitlines()]
    return ([d for d in lines if d.get("label") == "core"],
            [d for d in lines if d.get("label", "").startswith("frontend")])


PROFILE_KEYS = ("seqs", "step_ms", "schedule", "prepare", "forward_attention", "forward_linear",
                "forward_other", "lm_head", "sample", "update", "ipc_in", "ipc_out", "idle_or_loop")
FRONTEND_KEYS = ("detokenize_us_per_token", "stream_us_per_token", "ipc_us_per_token", "cpu_us_per_token")


def average_rows(rows: list[dict[str, str]], keys: tuple[str, ...] = PROFILE_KEYS,
                 weight: str = "steps") -> dict[str, float] | None:
    """The ``weight``-weighted mean of ``keys`` over profile lines (None for no lines)."""
    total = sum(float(r.get(weight, 0)) for r in rows)
    if not total:
        return None
    out = {k: sum(float(r.get(k, 0)) * float(r.get(weight, 0)) for r in rows) / total for k in keys}
    out[weight] = total
    return out


def profile_lbd(spec: EngineSpec, common: dict, workload: Workload, levels: list[int],
                requests: dict[int, int], workdir: Path, every: int) -> list[str]:
    """A separate lbd server with --profile-steps: its step breakdown on the same workload, per level."""
    prof_spec = EngineSpec(spec.name + "-profile", "lbd", spec.dtype,
                           [*spec.extra, "--profile-steps", str(every)], dict(spec.env), spec.src)
    eng = RunningEngine(prof_spec, log=workdir / f"{prof_spec.name}.log", **common)
    out = ["| conc | step kind | steps | seqs | step ms | schedule | prepare | attention | linear | "
           "other fwd | lm_head | sample | update | IPC in+out | loop | "
           "front end us/token: detok / SSE / IPC / CPU |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    try:
        for c in levels:
            core, fe = profile_level(eng, workload, c, requests[c])
            f = average_rows(fe, FRONTEND_KEYS, "tokens") or dict.fromkeys(FRONTEND_KEYS, 0.0)
            fe_part = " / ".join(f"{f[k]:.0f}" for k in FRONTEND_KEYS)
            for kind in ("decode", "mixed"):
                a = average_rows([r for r in core if r.get("kind") == kind])
                if a is None:
                    continue
                out.append(f"| {c} | {kind} | {a['steps']:.0f} | {a['seqs']:.0f} | {a['step_ms']:.1f} | "
                           f"{a['schedule']:.2f} | {a['prepare']:.2f} | {a['forward_attention']:.1f} | "
                           f"{a['forward_linear']:.1f} | {a['forward_other']:.1f} | {a['lm_head']:.1f} | "
                           f"{a['sample']:.2f} | {a['update']:.2f} | {a['ipc_in'] + a['ipc_out']:.2f} | "
                           f"{a['idle_or_loop']:.2f} | {fe_part} |")
    finally:
        eng.close()
    return out


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--engines", default="lbd,vllm", help="comma list of " + ", ".join(ENGINES) + ", or all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: --requests-factor x the concurrency, at least 4)")
    p.add_argument("--requests-factor", type=float, default=2.0,
                   help="requests per run per unit of concurrency when --requests is not given")
    p.add_argument("--input-len", type=int, default=125)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--model", default=None, help="HF folder (default: the bundled SmolLM2, converted once)")
    p.add_argument("--cpus", default=None, help="CPUs both engines use, e.g. 0-1 (default: all of ours)")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV-cache GiB for each engine")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--lbd-base-src", type=Path, default=None,
                   help="another lbd source tree (e.g. `git archive OLD | tar -x -C DIR`), run as engine "
                        "lbd-base (fp32) in the same rounds: a change measured side by side with its parent")
    p.add_argument("--lbd-base-args", default="",
                   help="extra flags of engine lbd-base, e.g. \"--max-prefill-tokens-with-decodes 512\": a "
                        "flag measured side by side with its default (with --lbd-base-src or without: then "
                        "lbd-base runs this tree)")
    p.add_argument("--profile", action="store_true", help="also print lbd's step breakdown (--profile-steps)")
    p.add_argument("--profile-every", type=int, default=16, help="steps per --profile-steps window")
    p.add_argument("--profile-levels", default=None, help="concurrency levels of --profile (default: all)")
    p.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    g = p.add_argument_group("--device cuda (benchmarks/engine_cuda.py)")
    g.add_argument("--cuda-shape", default="llama3-8b", choices=["llama3-8b", "tiny"],
                   help="shape of the random-weight checkpoint the CUDA mode writes")
    g.add_argument("--cuda-on-cpu", action="store_true",
                   help="run the CUDA mode's pipeline on the CPU (with --cuda-shape tiny: a smoke test)")
    g.add_argument("--work-dir", type=Path, default=None,
                   help="where the CUDA mode caches its checkpoint (default: $LBD_CACHE_DIR or ~/.cache/lbd)")
    return p.parse_args(argv)


def cpu_list() -> tuple[str, int]:
    cpus = sorted(os.sched_getaffinity(0))
    ranges, start = [], cpus[0]
    for prev, cur in zip(cpus, [*cpus[1:], None], strict=True):
        if cur != prev + 1:
            ranges.append(f"{start}-{prev}" if prev != start else str(start))
            start = cur
    return ",".join(ranges), len(cpus)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support import exit_on_sigterm

    exit_on_sigterm()
    args = parse_args(argv)
    if args.device == "cuda":
        from benchmarks.engine_cuda import main as cuda_main

        return cuda_main(args)
    if args.lbd_base_src is not None or args.lbd_base_args:
        src = (args.lbd_base_src or Path(__file__).resolve().parents[1]).resolve()
        if not any((src / d / "__main__.py").is_file() for d in ("src/lbd/engine", "engine")):
            print(f"--lbd-base-src {src}: no src/lbd/engine/__main__.py there (pass an lbd source tree)",
                  file=sys.stderr)
            return 2
        ENGINES["lbd-base"] = EngineSpec("lbd-base", "lbd", extra=shlex.split(args.lbd_base_args), src=src)
    names = list(ENGINES) if args.engines == "all" else [e for e in args.engines.split(",") if e.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        print(f"unknown --engines {unknown}: choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    report = Report()
    why = vllm_available(args.vllm_python)
    if why and any(ENGINES[n].kind == "vllm" for n in names):
        report.notes.append(f"vLLM skipped: {why}")
        names = [n for n in names if ENGINES[n].kind != "vllm"]
    levels = [int(c) for c in args.concurrency.split(",")]
    requests = {c: args.requests or max(4, round(args.requests_factor * c)) for c in levels}
    from lbd.engine.loader import resolve_model

    model = Path(resolve_model(args.model))
    cfg = json.loads((model / "config.json").read_text())
    workload = Workload(args.input_len, args.output_len, cfg["vocab_size"])
    cpus, threads = (args.cpus, len(_expand(args.cpus))) if args.cpus else cpu_list()
    workdir = Path(tempfile.mkdtemp(prefix="lbd-vs-vllm-"))
    common = dict(model=model, cpus=cpus, threads=threads, kv_gib=args.kv_gib,
                  max_model_len=args.max_model_len, device="cpu", python=args.vllm_python,
                  ready_timeout=args.ready_timeout)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}  model {model.name}  cpus {cpus}  engines {names}  levels "
          f"{levels}  requests {requests}  {args.input_len} in / {args.output_len} out  logs in {workdir}",
          flush=True)
    engines: dict[str, RunningEngine] = {}
    try:
        for n in names:
            try:
                engines[n] = RunningEngine(ENGINES[n], log=workdir / f"{n}.log", **common)
            except Exception as e:  # a peer that cannot start (e.g. no bf16 on this CPU) loses its rows only
                report.notes.append(f"{n} did not start: {e}; see {workdir / (n + '.log')}")
                continue
            report.startup[n] = engines[n].startup_s
            print(f"started {n} in {engines[n].startup_s:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
        for eng in engines.values():  # warm-up: a short burst each, not measured
            measure(eng, workload.prompts(8, 99, 8), 16, 8, -1)
        _greedy_check(engines, report)
        order = list(engines)
        for rnd in range(args.rounds):
            for c in levels:
                prompts = workload.prompts(requests[c], rnd, c)
                for n in (order if rnd % 2 == 0 else order[::-1]):
                    run = measure(engines[n], prompts, args.output_len, c, rnd)
                    report.runs.append(run)
                    print(f"round {rnd} c={c:<3} {n:<10} {run.tok_s:7.1f} tok/s  ITL p50 "
                          f"{_ms(percentile(run.itl, 50))} p99 {_ms(percentile(run.itl, 99))} ms  "
                          f"front end {run.fe_cpu_s / run.wall_s:.2f} cores  load {run.load:.1f}", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    present = list(engines)
    print(f"\n## lbd vs vLLM, {time.strftime('%Y-%m-%d')}, {threads} CPUs ({cpus}), {model.name}, "
          f"{args.input_len} in / {args.output_len} out, {args.rounds} rounds\n")
    print("start-up (spawn -> first answer): "
          + ", ".join(f"{n} {s:.1f} s" for n, s in report.startup.items()))
    for line in report.notes:
        print(f"note: {line}")
    print()
    print("\n".join(report.table(present, levels)))
    print()
    print("\n".join(report.ratios(present, levels)))
    if args.profile:
        prof_levels = [int(c) for c in args.profile_levels.split(",")] if args.profile_levels else levels
        prof_requests = {c: requests.get(c) or max(4, round(args.requests_factor * c)) for c in prof_levels}
        for n in [x for x in ("lbd", "lbd-base", "lbd-bf16") if x in present]:
            print(f"\nstep breakdown, {n} (ms per step; a separate server with --profile-steps "
                  f"{args.profile_every}):\n")
            print("\n".join(profile_lbd(ENGINES[n], common, workload, prof_levels, prof_requests, workdir,
                                        args.profile_every)))
    if args.json:
        args.json.write_text(json.dumps({"startup": report.startup, "notes": report.notes,
                                         "runs": [_run_dict(r) for r in report.runs]}, indent=1))
    return 0


def _greedy_check(engines: dict[str, RunningEngine], report: Report) -> None:
    for a, b in (("lbd", "vllm"), ("lbd-bf16", "vllm-bf16")):
        if a in engines and b in engines:
            same, notes = compare_texts(greedy_texts(engines[a], 32), greedy_texts(engines[b], 32))
            report.notes.append(f"greedy texts {a} vs {b}: {same} of {len(GREEDY_PROMPTS)} identical "
                                "(32 tokens each)" + "".join(f"; {n}" for n in notes))
            print(report.notes[-1], flush=True)


def _run_dict(r: Run) -> dict:
    return {"engine": r.engine, "concurrency": r.concurrency, "round": r.round, "wall_s": r.wall_s,
            "tokens": r.tokens, "tok_s": r.tok_s, "errors": r.errors, "ttft_p50": percentile(r.ttft, 50),
            "ttft_p99": percentile(r.ttft, 99), "itl_p50": percentile(r.itl, 50),
            "itl_p99": percentile(r.itl, 99), "fe_cpu_s": r.fe_cpu_s, "engine_cpu_s": r.engine_cpu_s,
            "load": r.load}


def _expand(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


if __name__ == "__main__":
    sys.exit(main())
