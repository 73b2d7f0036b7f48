"""Tables, verdicts and the plot of benchmarks/routing_quality.py (rows come from its runs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lbd.bench.stats import percentile

OURS = "lbd:predicted_ttft"  # the default policy with KV events (auto)
BASELINE = "lbd:round_robin"  # stepped workloads: steps go up until this one saturates
SATURATED = 2.0  # a target saturates at the first step whose median TTFT is this many times its first step's


def saturated_step(p50s: list[float]) -> int | None:
    """Index of the first step where the median request waits in a queue as long as it computes: its p50
    TTFT at least SATURATED x the first step's (a completion-rate test cannot tell: the sessions' later turns
    are sent only once the earlier ones are answered, so a saturated target also slows its own arrivals)."""
    return next((i for i, v in enumerate(p50s) if i and v >= SATURATED * p50s[0]), None)


@dataclass(slots=True)
class Row:
    workload: str
    target: str
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    short_ttft_p99_ms: float  # skew: p99 TTFT of the short prompts alone (the ones stuck behind long ones)
    itl_p99_ms: float
    output_tok_s: float
    hit_rate: float
    oracle_hit_rate: float
    oracle_length_matches: str  # prompts the oracle tokenized to the server's length / all
    max_per_rank: int
    min_per_rank: int
    errors: dict[str, int] = field(default_factory=dict)
    ttfts_ms: list[float] = field(default_factory=list)
    host_cpu_percent: float = math.nan
    own_cores: float = math.nan
    ttft_p90_ms: float = math.nan
    step_rate: float = math.nan  # stepped workloads: the step's simulated request rate
    reasons: dict[str, int] = field(default_factory=dict)  # lbd: routing decisions by reason (whole run)
    # The start-up cluster (see ``startup_split``): requests sent before every prefix group's first request
    # had its first token, p99 TTFT of the others, and how many of the slowest 1% are start-up requests.
    startup_requests: int = 0
    steady_ttft_p99_ms: float = math.nan
    slowest_startup: str = ""  # "k/n": k of the n slowest requests (the top 1%) are start-up requests
    run: int = 0  # --repeat: which round of the interleaved targets
    cold_requests: int = 0  # prefix groups' first requests (see ``cold_waits``)
    cold_waited: int = 0  # of those, the ones that waited for other work on their rank
    load_avg: float = math.nan  # the host's 1-minute load average when the run ended
    router_overhead_ms: float = math.nan  # lbd: p95 real ms from a request's arrival to its dispatch
    router_overhead_mean_ms: float = math.nan  # lbd: the mean of the same
    cold_ttfts: list[tuple[int, int, float]] = field(default_factory=list)  # (group, prompt tokens, TTFT ms)

    @property
    def hit_vs_oracle(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else math.nan


def startup_split(records: list[Any], scale: float) -> tuple[int, float, str]:
    """(start-up requests, p99 TTFT ms of the rest, "k/n" of the slowest 1% that are start-up requests).

    Start-up ends when every prefix group's first request has its first token: until then some group's
    prefix is being computed for the first time (a cold prefill no router avoids) and its group's other
    requests queue behind it. A p99 over a run is the run's ~20th-worst request of 2,000; when most of those
    are start-up requests, the p99 measures the cold start, not the routing. ``records`` are the client's
    (``lbd.bench.client.RequestRecord``); times come back in simulated ms (divided by ``scale``)."""
    ok = sorted((r for r in records if r.ok and r.ttft is not None), key=lambda r: r.start)
    if not ok:
        return 0, math.nan, ""
    first: dict[int, Any] = {}
    for r in ok:
        first.setdefault(r.group, r)
    warm_from = max(r.start + r.ttft for r in first.values())
    steady = [r.ttft for r in ok if r.start >= warm_from]
    n = max(1, len(ok) // 100)
    slowest = sorted(ok, key=lambda r: r.ttft)[-n:]
    k = sum(r.start < warm_from for r in slowest)
    p99 = percentile(steady, 99) * 1e3 / scale if steady else math.nan
    return len(ok) - len(steady), p99, f"{k}/{n}"


def cold_requests(records: list[Any]) -> list[Any]:
    """Each prefix group's first answered request (the one that found no rank holding its prompt), in
    arrival order."""
    first: dict[int, Any] = {}
    for r in sorted((r for r in records if r.ok and r.ttft is not None), key=lambda r: r.start):
        first.setdefault(r.group, r)
    return sorted(first.values(), key=lambda r: r.start)


def cold_waits(records: list[Any], factor: float = 1.2) -> tuple[int, int]:
    """(cold requests, cold requests that waited for other work on their rank), from the client's records.

    A cold request is its prefix group's first: no rank holds its prompt, so its TTFT is one prefill of it
    plus whatever its rank computed first. It counts as waited when its TTFT is past ``factor`` x the run's
    fastest cold TTFT (a bare cold prefill varies by under 1.12x with the decodes beside it on the sim
    profiles). Whether another rank was free then is not known here (the client does not see ranks)."""
    cold = cold_requests(records)
    if not cold:
        return 0, 0
    floor = min(r.ttft for r in cold)
    return len(cold), sum(1 for r in cold if r.ttft > factor * floor)


def table(rows: list[Row]) -> str:
    """One markdown table; the short-prompt p99 column only where the workload has short prompts."""
    shorts = any(math.isfinite(r.short_ttft_p99_ms) for r in rows)
    header = [
        "target",
        "TTFT p50 ms",
        "TTFT p99 ms",
        *(["short-prompt TTFT p99 ms"] if shorts else []),
        "p99 after start-up ms",
        "slowest 1%: start-up",
        "ITL p99 ms",
        "out tok/s",
        "prefix hit",
        "hit/oracle",
        "req/rank max/min",
        "errors",
    ]
    body = [
        [
            r.target,
            f"{r.ttft_p50_ms:,.1f}",
            f"{r.ttft_p99_ms:,.1f}",
            *([f"{r.short_ttft_p99_ms:,.1f}"] if shorts else []),
            f"{r.steady_ttft_p99_ms:,.1f}",
            r.slowest_startup or "-",
            f"{r.itl_p99_ms:,.1f}",
            f"{r.output_tok_s:,.0f}",
            f"{100 * r.hit_rate:.1f}%",
            f"{100 * r.hit_vs_oracle:.0f}%" if r.oracle_hit_rate > 0 else "-",
            f"{r.max_per_rank}/{r.min_per_rank}",
            str(r.failed),
        ]
        for r in rows
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def runs_table(rows: list[Row]) -> str:
    """One line per run of each target (--repeat): TTFT percentiles, cold requests that waited, host load."""
    out = [
        "| run | target | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | cold waited / cold | hit / oracle "
        "| lbd overhead mean / p95 ms (real) | load avg |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in sorted(rows, key=lambda r: r.run):
        over = "-" if math.isnan(r.router_overhead_ms) else (
            f"{r.router_overhead_mean_ms:.2f} / {r.router_overhead_ms:.1f}")
        out.append(
            f"| {r.run} | {r.target} | {r.ttft_p50_ms:,.1f} | {r.ttft_p90_ms:,.1f} | {r.ttft_p99_ms:,.1f} "
            f"| {r.cold_waited}/{r.cold_requests} | {100 * r.hit_vs_oracle:.0f}% "
            f"| {over} | {r.load_avg:.1f} |"
        )
    return "\n".join(out)


def cold_table(rows: list[Row]) -> str:
    """Every run's cold requests side by side, longest prompt first: each group's first request under each
    target (the same prompt: the workload is seeded), so a tail set by the prefills themselves shows as
    equal rows, and a placement that stacked or delayed one shows as the row that differs."""
    out = []
    for run in sorted({r.run for r in rows}):
        mine = [r for r in rows if r.run == run and r.cold_ttfts]
        if not mine:
            continue
        by_target = [{g: ms for g, _, ms in r.cold_ttfts} for r in mine]
        tokens = {g: n for r in mine for g, n, _ in r.cold_ttfts}
        out += [f"\nrun {run}: cold requests (simulated ms), longest prompt first\n",
                "| group | prompt tokens | " + " | ".join(r.target for r in mine) + " |",
                "|---:|---:|" + "---:|" * len(mine)]
        for g in sorted(tokens, key=lambda g: -tokens[g]):
            cells = " | ".join(f"{t[g]:.2f}" if g in t else "-" for t in by_target)
            out.append(f"| {g} | {tokens[g]:,} | {cells} |")
    return "\n".join(out)


def step_table(rows: list[Row]) -> str:
    """A stepped workload: one line per target and step, TTFT p50/p90 and output tok/s."""
    header = [
        "target",
        "step req/s",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "out tok/s",
        "prefix hit",
        "hit/oracle",
        "req/rank max/min",
        "errors",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in sorted(rows, key=lambda r: (r.step_rate, r.target)):
        cells = [
            r.target,
            f"{r.step_rate:g}",
            f"{r.ttft_p50_ms:,.1f}",
            f"{r.ttft_p90_ms:,.1f}",
            f"{r.output_tok_s:,.0f}",
            f"{100 * r.hit_rate:.1f}%",
            f"{100 * r.hit_vs_oracle:.0f}%" if r.oracle_hit_rate > 0 else "-",
            f"{r.max_per_rank}/{r.min_per_rank}",
            str(r.failed),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    """The issue's targets (13), each MET or MISSED with the numbers behind it."""
    out: list[str] = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'MET' if ok else 'MISSED'}: {text}")

    for wl in dict.fromkeys(r.workload for r in rows):
        mine = [r for r in rows if r.workload == wl]
        peers = [r for r in mine if not r.target.startswith("lbd:")]
        stepped = any(math.isfinite(r.step_rate) for r in mine)
        if stepped:
            rr = sorted((r for r in mine if r.target == BASELINE), key=lambda r: r.step_rate)
            k = saturated_step([r.ttft_p50_ms for r in rr])
            where = f"at {rr[k].step_rate:g} req/s (p50 TTFT {rr[k].ttft_p50_ms:,.1f} ms)" if k else "nowhere"
            line(
                k is not None,
                f"{wl}: round robin saturates {where} (p50 >= {SATURATED:g}x its first step's)"
                + ("" if rr else "; round robin not in this run"),
            )
            top = max(r.step_rate for r in mine)
            at_top = [r for r in mine if r.step_rate == top]
            peers_top = [r for r in at_top if not r.target.startswith("lbd:")]
            best = min(peers_top, key=lambda r: r.ttft_p90_ms, default=None)
            for me in (r for r in at_top if r.target.startswith(OURS)):
                if best is not None:
                    ratio = best.ttft_p90_ms / me.ttft_p90_ms if me.ttft_p90_ms else math.inf
                    line(
                        ratio >= 2.0,
                        f"{wl} at {top:g} req/s: {me.target} p90 TTFT {me.ttft_p90_ms:,.1f} ms vs "
                        f"best peer {best.target} {best.ttft_p90_ms:,.1f} ms = {ratio:.2f}x lower "
                        "(target >= 2x)",
                    )
            continue
        best = min(peers, key=lambda r: r.ttft_p99_ms, default=None)
        if wl.startswith("long/short"):
            others = [r for r in mine if not r.target.startswith(OURS)]
            rival = min(others, key=lambda r: r.ttft_p99_ms, default=None)
            me = next((r for r in mine if r.target == OURS), None)
            if me is not None and rival is not None:
                line(
                    me.ttft_p99_ms <= rival.ttft_p99_ms * 1.05,
                    f"{wl}: {OURS} p99 TTFT {me.ttft_p99_ms:,.1f} ms vs the best other target {rival.target} "
                    f"{rival.ttft_p99_ms:,.1f} ms (at least as good, 5% noise allowed)",
                )
            continue
        for me in (r for r in mine if r.target.startswith(OURS) and "approx" not in r.target):
            if best is not None:
                line(
                    me.ttft_p99_ms < best.ttft_p99_ms,
                    f"{wl}: {me.target} p99 TTFT {me.ttft_p99_ms:,.1f} ms vs "
                    f"best peer {best.target} {best.ttft_p99_ms:,.1f} ms",
                )
            if me.oracle_hit_rate > 0:
                line(
                    me.hit_vs_oracle >= 0.98,
                    f"{wl}: {me.target} prefix hit {100 * me.hit_rate:.1f}% = "
                    f"{100 * me.hit_vs_oracle:.1f}% of the oracle's (target >= 98%)",
                )
    return out


def plot(rows: list[Row], path: Path, scale: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = {wl: max(r.step_rate for r in rows if r.workload == wl) for wl in {r.workload for r in rows}}
    rows = [r for r in rows if not math.isfinite(r.step_rate) or r.step_rate == top[r.workload]]

    names = list(dict.fromkeys(r.workload for r in rows))
    palette = plt.get_cmap("tab10").colors
    color = {t: palette[i % len(palette)] for i, t in enumerate(dict.fromkeys(r.target for r in rows))}
    fig, axes = plt.subplots(len(names), 2, figsize=(14, 5 * len(names)), squeeze=False)
    for i, wl in enumerate(names):
        mine = [r for r in rows if r.workload == wl]
        ax = axes[i][0]
        for r in mine:
            xs = sorted(r.ttfts_ms)
            ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=r.target, color=color[r.target])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, simulated H100 time)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{wl}: TTFT CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[i][1]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r.ttft_p99_ms for r in mine], width=0.4, label="TTFT p99 (ms)")
        ax.set_ylabel("TTFT p99 (ms)")
        ax2 = ax.twinx()
        ax2.bar(
            [x + 0.2 for x in xs],
            [100 * r.hit_rate for r in mine],
            width=0.4,
            color="tab:orange",
            label="prefix hit rate (%)",
        )
        ax2.set_ylabel("prefix-cache hit rate (%)")
        ax2.set_ylim(0, 100)
        ax.set_xticks(list(xs), [r.target for r in mine], rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{wl}: p99 TTFT (blue) and prefix hit rate (orange)")
    fig.suptitle(f"Routing quality: 8 simulated H100 ranks (Llama-3-8B), time scale {scale:g}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)
    plt.close(fig)
