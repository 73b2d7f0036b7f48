"""--plot: latency CDFs (TTFT, ITL, E2E) and output throughput over time, one line per target.

matplotlib is imported here only, with the Agg backend (no display needed)."""

from __future__ import annotations

from pathlib import Path

from lbd.bench.runner import RunResult
from lbd.bench.stats import timeline


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(v * 1e3 for v in values)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def plot_runs(results: list[RunResult], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (axes[0][0], "TTFT (ms)", lambda r: [x.ttft for x in r.records if x.ok and x.ttft is not None]),
        (axes[0][1], "Inter-token latency (ms)", lambda r: [g for x in r.records if x.ok for g in x.itl]),
        (
            axes[1][0],
            "End-to-end latency (ms)",
            lambda r: [x.e2e for x in r.records if x.ok and x.e2e is not None],
        ),
    )
    for ax, label, pick in panels:
        for result in results:
            xs, ys = _cdf(pick(result))
            if xs:
                ax.plot(xs, ys, label=result.target.name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if "Inter" not in label else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[1][1]
    for result in results:
        tl = timeline(result.records)
        ax.plot(tl["t"], tl["output_tok_s"], label=result.target.name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
