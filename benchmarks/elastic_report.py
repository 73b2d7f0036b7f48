"""benchmarks/elastic.py's numbers: TTFT-SLO attainment, ranks per load level, each resize read from the
poller's records, the requests each scale-down touched, and the time from a step up to the added ranks
serving. Pure functions of the records (elastic_load.Record, Poller rows and resizes)."""

from __future__ import annotations

from elastic_load import Phase, Poller, Record


def attainment(records: list[Record], slo_s: float) -> float | None:
    """The share of requests whose first token came within ``slo_s`` (an error or a cut before any token is
    a miss)."""
    if not records:
        return None
    return sum(r.ttft is not None and r.ttft <= slo_s for r in records) / len(records)


def ttft_quantile(records: list[Record], q: float) -> float | None:
    got = sorted(r.ttft for r in records if r.ttft is not None)
    return round(got[min(len(got) - 1, int(q * len(got)))], 3) if got else None


def bounds(phases: list[Phase]) -> list[tuple[float, float]]:
    out, t = [], 0.0
    for ph in phases:
        out.append((t, t + ph.seconds))
        t += ph.seconds
    return out


def mean_of(rows: list[dict], key: str, start: float, end: float) -> float | None:
    vals = [r[key] for r in rows if start <= r["t"] < end and r.get(key) is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


def resizes(poller: Poller) -> list[dict]:
    """Every resize the node ran, in order: direction, sizes, start and end (s since t0), outcome."""
    out = []
    for started, s in sorted(poller.resizes.items()):
        out.append({"direction": "grow" if s["target"] > s["previous"] else "shrink",
                    "previous": s["previous"], "target": s["target"], "state": s["state"],
                    "start": poller.rel(started), "end": poller.rel(s.get("finished_at")),
                    "added": s.get("added"), "removing": s.get("removing"), "error": s.get("error")})
    return out


def scale_downs(events: list[dict], records: list[Record], grace_s: float = 5.0) -> list[dict]:
    """Per shrink: streams in flight when it began (longs among them), and the client errors and cut
    streams among the requests that overlapped it (from its start to ``grace_s`` after its end)."""
    out = []
    for e in events:
        if e["direction"] != "shrink" or e["start"] is None:
            continue
        end = (e["end"] if e["end"] is not None else e["start"]) + grace_s
        running = [r for r in records if r.start < e["start"] and (r.end is None or r.end > e["start"])]
        touched = [r for r in records if r.start < end and (r.end is None or r.end > e["start"])]
        bad = [r for r in touched if r.outcome != "ok"]
        out.append({"at_s": e["start"], "sizes": f"{e['previous']}->{e['target']}",
                    "took_s": None if e["end"] is None else round(e["end"] - e["start"], 1),
                    "in_flight": len(running), "long_in_flight": sum(r.kind == "long" for r in running),
                    "errors": sum(r.outcome == "error" for r in bad),
                    "cut": sum(r.outcome == "cut" for r in bad),
                    "reasons": sorted({r.reason for r in bad})[:5]})
    return out


def step_ups(phases: list[Phase], rows: list[dict], events: list[dict]) -> list[dict]:
    """Per step up: seconds from the step to the first grow decided (resize begun), to its ranks ready
    (resize done), to the router routing to more ranks than at the step, and to the phase's largest size
    routed."""
    out = []
    spans = bounds(phases)
    for n in range(1, len(phases)):
        if phases[n].level <= phases[n - 1].level:
            continue
        step, end = spans[n]
        before = [r for r in rows if r["t"] <= step]
        base = before[-1]["routed"] if before else 0
        during = [r for r in rows if step <= r["t"] < end]
        most = max((r["routed"] for r in during), default=base)
        grows = [e for e in events if e["direction"] == "grow" and e["start"] is not None
                 and step <= e["start"] < end]
        first_more = next((r["t"] for r in during if r["routed"] > base), None)
        first_most = next((r["t"] for r in during if r["routed"] == most), None) if most > base else None
        out.append({"step_at_s": step, "level": f"{phases[n - 1].level:g}x->{phases[n].level:g}x",
                    "routed_before": base, "routed_max": most,
                    "to_first_grow_decided_s": _since(grows[0]["start"] if grows else None, step),
                    "to_first_grow_ready_s": _since(grows[0]["end"] if grows else None, step),
                    "to_first_added_routed_s": _since(first_more, step),
                    "to_max_routed_s": _since(first_most, step),
                    "grows": [f"{e['previous']}->{e['target']} ({e['state']})" for e in grows]})
    return out


def _since(t: float | None, step: float) -> float | None:
    return None if t is None else round(t - step, 1)


def phase_table(phases: list[Phase], records: list[Record], rows: list[dict], slo_s: float,
                settle_s: float) -> list[dict]:
    """Per phase: requests, SLO attainment, TTFT p50/p95, mean ranks running and routed (whole phase, and
    after ``settle_s``), errors and cuts."""
    out = []
    for n, ((start, end), ph) in enumerate(zip(bounds(phases), phases, strict=True)):
        mine = [r for r in records if r.phase == n]
        out.append({"phase": n, "level": ph.level, "from_s": start, "to_s": end, "requests": len(mine),
                    "attainment": _pct(attainment(mine, slo_s)), "ttft_p50_s": ttft_quantile(mine, 0.5),
                    "ttft_p95_s": ttft_quantile(mine, 0.95),
                    "ranks_mean": mean_of(rows, "ranks", start, end),
                    "routed_mean": mean_of(rows, "routed", start, end),
                    "ranks_mean_settled": mean_of(rows, "ranks", min(end, start + settle_s), end),
                    "errors": sum(r.outcome == "error" for r in mine),
                    "cut": sum(r.outcome == "cut" for r in mine),
                    "load1": mean_of(rows, "load1", start, end)})
    return out


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100 * x, 1)


def needed(sweep: list[dict], target: float) -> dict[float, int | None]:
    """Per load level: the smallest fixed size whose SLO attainment met ``target`` (%) in the sweep."""
    out: dict[float, int | None] = {}
    for row in sorted(sweep, key=lambda r: (r["level"], r["size"])):
        out.setdefault(row["level"], None)
        if out[row["level"]] is None and row["attainment"] is not None and row["attainment"] >= target:
            out[row["level"]] = row["size"]
    return out
