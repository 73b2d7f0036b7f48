"""KV-transfer metrics (``lbd:kv_transfer_*``), recorded by the core process (Prometheus multiprocess mode,
as the rest of ``lbd.engine.metrics``): blocks and bytes moved, bytes per token of the KV layout, pulls that
failed (the prefill was recomputed), leases pending, expired and refused (the caps), blocks held, params and
producers a consumer did not trust, pull time. Families are made once per
process (a second core in one process, as in tests, reuses them)."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

LABELS = ("model_name", "engine")
PULL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_FAMILIES: dict[str, Any] = {}


def _families() -> dict[str, Any]:
    if _FAMILIES:
        return _FAMILIES
    by_dir = (*LABELS, "direction")

    def gauge(name: str, doc: str) -> Gauge:
        return Gauge(name, doc, LABELS, multiprocess_mode="mostrecent")

    _FAMILIES.update(
        blocks=Counter("lbd:kv_transfer_blocks", "KV blocks of remote-prefilled requests: pulled in, served "
                       "out, or found in this rank's prefix cache (local).", by_dir),
        bytes=Counter("lbd:kv_transfer_bytes", "KV-transfer bytes moved, pulled in or served out.", by_dir),
        failed=Counter("lbd:kv_transfer_failed_pulls",
                       "Pulls that failed or timed out: the decode rank recomputed the prefill.", LABELS),
        expired=Counter("lbd:kv_transfer_expired_leases",
                        "Producer block leases nobody pulled before the deadline (freed).", LABELS),
        pending=gauge("lbd:kv_transfer_pending_leases", "Producer block leases waiting for a pull."),
        held=gauge("lbd:kv_transfer_lease_blocks", "KV blocks a producer holds under leases for pulls."),
        refused=Counter("lbd:kv_transfer_lease_refusals", "Prefills whose blocks a producer did not hold for "
                        "a pull (its lease cap by count or bytes was reached): their decode recomputes.",
                        (*LABELS, "reason")),
        untrusted=Counter("lbd:kv_transfer_untrusted", "Pulls a consumer did not make, or whose answer it "
                          "dropped: params no producer it shares the key with signed, or a producer that "
                          "gave no proof of the key (the prefill was recomputed).", LABELS),
        waiting=gauge("lbd:kv_transfer_pulls_in_flight", "Decode requests waiting for their blocks."),
        per_token=gauge("lbd:kv_transfer_bytes_per_token",
                        "KV bytes per token of this rank's cache layout (what a transfer moves per token)."),
        nixl=Counter("lbd:kv_transfer_nixl_reads", "Pulls whose blocks came by a NIXL READ (NixlConnector on "
                     "both ends), of the pulls counted in lbd:kv_transfer_pull_seconds.", LABELS),
        seconds=Histogram("lbd:kv_transfer_pull_seconds", "Time of one KV pull, asked to landed.", LABELS,
                          buckets=PULL_SECONDS_BUCKETS),
    )
    return _FAMILIES


class KVTransferMetrics:
    def __init__(self, labels: dict[str, str] | None, block_bytes: int, block_size: int) -> None:
        lv = labels or {"model_name": "", "engine": "0"}
        f = _families()
        self.block_bytes = block_bytes
        self.blocks_in = f["blocks"].labels(**lv, direction="pulled")
        self.blocks_out = f["blocks"].labels(**lv, direction="served")
        self.local_blocks = f["blocks"].labels(**lv, direction="local")
        self.bytes_in = f["bytes"].labels(**lv, direction="pulled")
        self.bytes_out = f["bytes"].labels(**lv, direction="served")
        self.failed = f["failed"].labels(**lv)
        self.expired = f["expired"].labels(**lv)
        self.pending = f["pending"].labels(**lv)
        self.held = f["held"].labels(**lv)
        self.refused_count = f["refused"].labels(**lv, reason="count")
        self.refused_bytes = f["refused"].labels(**lv, reason="bytes")
        self.untrusted = f["untrusted"].labels(**lv)
        self.pulls_waiting = f["waiting"].labels(**lv)
        self.pull_seconds = f["seconds"].labels(**lv)
        self.nixl_reads = f["nixl"].labels(**lv)
        f["per_token"].labels(**lv).set(block_bytes / block_size)

    def pulled(self, blocks: int, nbytes: int, seconds: float, nixl: bool = False) -> None:
        if nixl:
            self.nixl_reads.inc()
        self.blocks_in.inc(blocks)
        self.bytes_in.inc(nbytes)
        self.pull_seconds.observe(seconds)

    def served(self, blocks: int) -> None:
        """Called from the server thread (prometheus-client's values are thread-safe)."""
        self.bytes_out.inc(blocks * self.block_bytes)
        self.blocks_out.inc(blocks)
