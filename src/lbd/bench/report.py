"""Text reports: one block per run, or one side-by-side table for --compare."""

from __future__ import annotations

import math
from collections.abc import Callable

from lbd.bench.runner import RunResult
from lbd.bench.stats import Summary

_LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def _num(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{digits}f}"


def _errors(s: Summary) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "none"


def _rows() -> list[tuple[str, Callable[[Summary], str]]]:
    rows: list[tuple[str, Callable[[Summary], str]]] = [
        ("Successful requests", lambda s: str(s.completed)),
        ("Failed requests", lambda s: str(s.failed)),
        ("Errors by kind", _errors),
        ("Duration (s)", lambda s: _num(s.duration_s)),
        ("Prompt tokens", lambda s: f"{s.prompt_tokens:,}"),
        ("Output tokens", lambda s: f"{s.output_tokens:,}"),
        ("Request throughput (req/s)", lambda s: _num(s.request_throughput)),
        ("Output token throughput (tok/s)", lambda s: _num(s.output_throughput)),
        ("Total token throughput (tok/s)", lambda s: _num(s.total_token_throughput)),
        ("Goodput (req/s)", lambda s: _num(s.goodput)),
        ("Peak requests in flight", lambda s: str(s.max_concurrency_seen)),
    ]
    for label, attr in _LATENCIES:
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{label} {stat} (ms)", lambda s, a=attr, k=stat: _num(getattr(s, a)[k])))
    return rows


def format_run(result: RunResult, workload: str) -> str:
    s = result.summary
    title = f" lbd bench: {result.target.name} "
    lines = [
        f"{title:=^60}",
        f"{'Target':<40}{result.target.base_url}",
        f"{'Model':<40}{result.target.model}",
        f"{'Workload':<40}{workload}",
    ]
    lines += [
        f"{label:<40}{value(s)}"
        for label, value in _rows()
        if label != "Goodput (req/s)" or s.goodput is not None
    ]
    lines.append("=" * 60)
    return "\n".join(lines)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain text table, first column left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def format_compare(results: list[RunResult], workload: str) -> str:
    header = ["metric", *(r.target.name for r in results)]
    rows = [
        [label, *(value(r.summary) for r in results)]
        for label, value in _rows()
        if label != "Goodput (req/s)" or results[0].summary.goodput is not None
    ]
    return f"lbd bench --compare: {workload}\n" + format_table(header, rows)
