"""`lbd bench`: load-test an OpenAI-compatible endpoint, or several side by side with --compare."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import platform
import sys
from pathlib import Path

import orjson

from lbd.bench.client import Target
from lbd.bench.report import format_compare, format_run
from lbd.bench.runner import BenchConfig, RunResult, TargetError, run_target
from lbd.bench.stats import SloError, parse_slo
from lbd.bench.tokenizer import TokenizerError, load_tokenizer
from lbd.bench.workloads import WORKLOADS, TextSource, WorkloadError, WorkloadSpec

DEFAULT_NUM_PROMPTS = 100


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lbd bench",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Load-test any OpenAI-compatible endpoint: TTFT, ITL, E2E latency "
        "percentiles, throughput and goodput, from a seeded workload.",
    )
    g = p.add_argument_group("target")
    g.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (not with --compare)")
    g.add_argument(
        "--compare",
        nargs="+",
        metavar="NAME=URL",
        help="run the same seeded workload against each target in turn; one table, one plot",
    )
    g.add_argument("--label", help="name of the target in reports (default: its host:port)")
    g.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    g.add_argument(
        "--tokenizer", help="tokenizer folder or .gguf for prompt lengths (default: the default model's)"
    )
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="OpenAI API to call")
    g.add_argument("--header", action="append", default=[], metavar="NAME:VALUE", help="extra request header")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    g = p.add_argument_group("load")
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests to send (default {DEFAULT_NUM_PROMPTS}, or unlimited with --duration)",
    )
    g.add_argument("--duration", type=float, default=None, help="stop sending new requests after this many s")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: requests/s (inf = all at once; closed loop with --max-concurrency)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight; without --request-rate: closed loop of this many sessions",
    )
    g.add_argument("--warmup", type=int, default=0, help="requests sent first and not measured")
    g.add_argument("--seed", type=int, default=0, help="same seed, same workload")
    g.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream responses (needed for TTFT and inter-token latency)")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly max_tokens (vLLM's ignore_eos)",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")

    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=WORKLOADS, default="random", help="request mix to generate")
    g.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1±ratio)")
    g.add_argument(
        "--num-groups", type=int, default=8, help="shared-prefix, multi-turn: distinct system prompts"
    )
    g.add_argument("--system-prompt-len", type=int, default=1024, help="shared-prefix, multi-turn: tokens")
    g.add_argument(
        "--group-skew", type=float, default=0.0,
        help="shared-prefix, multi-turn: Zipf exponent of the system prompts' popularity (0: uniform)",
    )
    g.add_argument(
        "--group-burst", type=int, default=1,
        help="shared-prefix, multi-turn: sessions in a row from each drawn system prompt (a burst on it)",
    )
    g.add_argument(
        "--question-len", type=int, default=128, help="shared-prefix, multi-turn: tokens per question"
    )
    g.add_argument("--num-turns", type=int, default=4, help="multi-turn: turns per session")
    g.add_argument("--session-header", action="store_true", help="multi-turn: send X-Session-ID")
    g.add_argument("--think-time", type=float, default=0.0, help="multi-turn: seconds between turns")
    g.add_argument("--long-fraction", type=float, default=0.1, help="skew: share of long prompts")
    g.add_argument("--long-input-len", type=int, default=4096, help="skew: long prompt tokens")
    g.add_argument("--short-input-len", type=int, default=128, help="skew: short prompt tokens")
    g.add_argument("--workload-file", help="file: JSONL of {prompt} | {messages} | {turns: [...]} lines")

    g = p.add_argument_group("output")
    g.add_argument("--slo", help="goodput SLO, e.g. ttft=500,itl=50 (ms; keys ttft, itl, tpot, e2e)")
    g.add_argument("--result-json", help="write the summary and every request's timings here")
    g.add_argument("--plot", help="write latency CDFs and throughput over time to this PNG")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _targets(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Target]:
    if bool(ns.base_url) == bool(ns.compare):
        parser.error("give exactly one of --base-url URL or --compare NAME=URL ...")
    if ns.base_url:
        if not ns.base_url.startswith(("http://", "https://")):
            parser.error(f"--base-url {ns.base_url!r} must start with http:// or https://")
        name = ns.label or ns.base_url.split("://", 1)[1].rstrip("/")
        return [Target(name, ns.base_url, ns.model or "")]
    targets = []
    for item in ns.compare:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            parser.error(f"--compare {item!r}: use NAME=http://HOST:PORT")
        if any(t.name == name for t in targets):
            parser.error(f"--compare: the name {name!r} is used twice")
        targets.append(Target(name, url, ns.model or ""))
    return targets


def _headers(items: list[str], parser: argparse.ArgumentParser) -> dict[str, str]:
    headers = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            parser.error(f"--header {item!r}: use NAME:VALUE")
        headers[name.strip()] = value.strip()
    return headers


def _check_load(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for flag in ("num_prompts", "max_concurrency", "duration", "request_rate", "request_timeout"):
        value = getattr(ns, flag)
        if value is not None and not value > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if ns.burstiness <= 0:
        parser.error(f"--burstiness must be positive, got {ns.burstiness}")
    if ns.warmup < 0 or ns.think_time < 0:
        parser.error("--warmup and --think-time must be >= 0")
    if ns.num_prompts is None and ns.duration is None:
        ns.num_prompts = DEFAULT_NUM_PROMPTS
    if ns.num_prompts is None and math.isinf(ns.request_rate) and not ns.max_concurrency:
        parser.error("--duration with an unlimited --request-rate needs --max-concurrency or --num-prompts")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, BenchConfig, WorkloadSpec, list[Target]]:
    parser = make_parser()
    ns = parser.parse_args(argv)
    _check_load(ns, parser)
    targets = _targets(ns, parser)
    try:
        slo = parse_slo(ns.slo)
    except SloError as e:
        parser.error(str(e))
    spec = WorkloadSpec(
        name=ns.workload,
        input_len=ns.input_len,
        output_len=ns.output_len,
        range_ratio=ns.range_ratio,
        num_groups=ns.num_groups,
        group_skew=ns.group_skew,
        group_burst=ns.group_burst,
        system_prompt_len=ns.system_prompt_len,
        question_len=ns.question_len,
        num_turns=ns.num_turns,
        long_fraction=ns.long_fraction,
        long_input_len=ns.long_input_len,
        short_input_len=ns.short_input_len,
        file=ns.workload_file,
    )
    try:
        spec.check()
    except WorkloadError as e:
        parser.error(str(e))
    cfg = BenchConfig(
        endpoint=ns.endpoint,
        num_prompts=ns.num_prompts,
        duration=ns.duration,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        warmup=ns.warmup,
        seed=ns.seed,
        stream=ns.stream,
        ignore_eos=ns.ignore_eos,
        temperature=ns.temperature,
        session_header=ns.session_header,
        think_time=ns.think_time,
        headers=_headers(ns.header, parser),
        timeout=ns.request_timeout,
        slo=slo,
        progress=not ns.no_progress,
    )
    return ns, cfg, spec, targets


def describe_workload(spec: WorkloadSpec, cfg: BenchConfig) -> str:
    load = (
        f"rate {cfg.request_rate:g}/s burstiness {cfg.burstiness:g}"
        if math.isfinite(cfg.request_rate)
        else "all at once"
        if not cfg.max_concurrency
        else "closed loop"
    )
    if cfg.max_concurrency:
        load += f", concurrency {cfg.max_concurrency}"
    size = f"{cfg.num_prompts} requests" if cfg.num_prompts else f"{cfg.duration:g} s"
    return f"{spec.name} /v1/{cfg.endpoint}, {size}, {load}, seed {cfg.seed}"


def result_document(argv: list[str], cfg: BenchConfig, spec: WorkloadSpec, results: list[RunResult]) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.system()}",
        "argv": argv,
        "workload": dataclasses.asdict(spec),
        "config": dataclasses.asdict(cfg),
        "runs": [r.as_dict() for r in results],
    }


async def _run_all(
    cfg: BenchConfig, spec: WorkloadSpec, targets: list[Target], src: TextSource
) -> list[RunResult]:
    return [await run_target(cfg, spec, t, src) for t in targets]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ns, cfg, spec, targets = parse_args(argv)
    try:
        src = TextSource(load_tokenizer(ns.tokenizer))
    except TokenizerError as e:
        print(f"lbd bench: error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        results = runner(_run_all(cfg, spec, targets, src))
    except TargetError as e:
        print(f"lbd bench: error: {e}", file=sys.stderr)
        return 1
    workload = describe_workload(spec, cfg)
    if len(results) == 1:
        print(format_run(results[0], workload))
    else:
        print(format_compare(results, workload))
    if ns.result_json:
        Path(ns.result_json).write_bytes(
            orjson.dumps(result_document(argv, cfg, spec, results), option=orjson.OPT_INDENT_2)
        )
    if ns.plot:
        from lbd.bench.plot import plot_runs

        print(f"plot: {plot_runs(results, ns.plot, workload)}")
    return 0 if all(r.summary.completed for r in results) else 1
