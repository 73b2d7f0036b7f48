"""Summaries of a run: latency percentiles, throughput, goodput under an SLO, errors by kind."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from lbd.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


class SloError(ValueError):
    pass


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: list[float]) -> dict[str, float]:
    """mean and p50/p90/p99 of ``values`` (seconds in, milliseconds out)."""
    ms = [v * 1e3 for v in values]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    out["max"] = max(ms) if ms else math.nan
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """``ttft=500,itl=50`` (milliseconds; ``500ms`` and ``0.5s`` work too) -> {key: seconds}."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            raise SloError(f"--slo {text!r}: each part is KEY=VALUE with KEY in {', '.join(SLO_KEYS)}")
        value = value.strip().lower()
        scale = 1e-3
        if value.endswith("ms"):
            value = value[:-2]
        elif value.endswith("s"):
            value, scale = value[:-1], 1.0
        try:
            seconds = float(value) * scale
        except ValueError:
            raise SloError(f"--slo {text!r}: {key} needs a number of milliseconds, got {value!r}") from None
        if seconds <= 0:
            raise SloError(f"--slo {text!r}: {key} must be positive")
        slo[key] = seconds
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """ttft and e2e per request; itl = the request's mean inter-token gap; tpot likewise from e2e."""
    if not rec.ok:
        return False
    itl = sum(rec.itl) / len(rec.itl) if rec.itl else 0.0
    values = {"ttft": rec.ttft or 0.0, "e2e": rec.e2e or 0.0, "itl": itl, "tpot": rec.tpot or 0.0}
    return all(values[k] <= limit for k, limit in slo.items())


@dataclass(slots=True)
class Summary:
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]
    max_concurrency_seen: int

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def _max_overlap(records: list[RequestRecord]) -> int:
    events = sorted(
        [(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], e[1])
    )
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float]) -> Summary:
    ok = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return Summary(
        completed=len(ok),
        failed=len(records) - len(ok),
        errors=dict(Counter(r.error for r in records if r.error)),
        duration_s=duration_s,
        prompt_tokens=prompt,
        output_tokens=output,
        request_throughput=len(ok) / duration,
        output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        goodput=sum(meets_slo(r, slo) for r in ok) / duration if slo else None,
        ttft_ms=describe([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=describe([gap for r in ok for gap in r.itl]),
        tpot_ms=describe([t for r in ok if (t := r.tpot) is not None]),
        e2e_ms=describe([r.e2e for r in ok if r.e2e is not None]),
        max_concurrency_seen=_max_overlap(ok),
    )


def timeline(records: list[RequestRecord], bucket_s: float | None = None) -> dict[str, list[float]]:
    """Output tokens per second and finished requests per second, in ``bucket_s`` buckets of run time.

    A request's tokens are spread over its streaming time (first token to end), which is what a throughput
    plot should show for long generations."""
    ok = [r for r in records if r.ok and r.e2e is not None]
    if not ok:
        return {"t": [], "output_tok_s": [], "requests_s": []}
    last = max(r.end for r in ok)
    bucket_s = bucket_s or min(max(last / 40, 0.1), 10.0)  # about 40 points whatever the run's length
    n = int(last / bucket_s) + 1
    tokens = [0.0] * n
    finished = [0.0] * n
    for r in ok:
        finished[min(int(r.end / bucket_s), n - 1)] += 1
        first = r.start + (r.ttft or 0.0)
        span = max(r.end - first, 1e-9)
        for b in range(int(first / bucket_s), min(int(r.end / bucket_s), n - 1) + 1):
            lo, hi = max(first, b * bucket_s), min(r.end, (b + 1) * bucket_s)
            tokens[b] += r.output_tokens * max(hi - lo, 0.0) / span if r.end > first else 0.0
        if r.end <= first:
            tokens[min(int(r.end / bucket_s), n - 1)] += r.output_tokens
    return {
        "t": [(b + 0.5) * bucket_s for b in range(n)],
        "output_tok_s": [x / bucket_s for x in tokens],
        "requests_s": [x / bucket_s for x in finished],
    }
