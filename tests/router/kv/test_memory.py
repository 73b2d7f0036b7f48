"""The exact index's memory figure: it grows with the blocks, stays near what tracemalloc measures, and is
reported per endpoint and in all (/router/status's KV sections, /metrics). In-process. ~2 s."""

from __future__ import annotations

import gc
import random
import tracemalloc

from lbd.router.kv.endpoint import EndpointView
from lbd.router.kv.index import BlockIndex, EndpointBlocks
from lbd.router.kv.memory import IndexCollector, estimate
from lbd.router.kv.view import ExactView
from lbd.router.metrics import RouterMetrics

BS = 16


def _fill(eps: list[EndpointBlocks], chains: range, rng: random.Random, shared: bool) -> None:
    for ep in eps:
        for c in chains:
            tokens = (
                [c * 1000 + i for i in range(16 * BS)]
                if shared
                else [rng.randrange(1 << 17) for _ in range(16 * BS)]
            )
            ep.stored([rng.getrandbits(63) for _ in range(16)], None, tokens, BS)


def test_the_estimate_grows_with_the_blocks_and_is_near_the_measured_bytes() -> None:
    rng = random.Random(0)
    for n_eps, shared in ((4, False), (32, True)):
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            index = BlockIndex()
            eps = [index.endpoint() for _ in range(n_eps)]
            empty = estimate(index)
            _fill(eps, range(8), rng, shared)
            small = estimate(index)
            _fill(eps, range(8, 32), rng, shared)
            gc.collect()
            measured = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        big = estimate(index)
        assert empty.blocks == 0 and empty.bytes > 0
        assert empty.bytes < small.bytes < big.bytes
        assert big.blocks == n_eps * 32 * 16 and big.keys == (32 * 16 if shared else big.blocks)
        assert 0.6 < big.bytes / measured < 1.6, (big.bytes, measured)
        share = big.endpoint_bytes(len(eps[0]))
        assert abs(share * n_eps - big.bytes) < 0.01 * big.bytes  # the endpoints' shares add up


async def test_status_and_metrics_report_the_index() -> None:
    view = ExactView("auto", None, 1.0, 1.0, index=BlockIndex(max_blocks=10_000))  # type: ignore[arg-type]
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for url in urls:
        view.views[url] = EndpointView(url, frozenset, view.index.endpoint())
    _fill([view.views[urls[0]].blocks], range(4), random.Random(1), False)
    whole = view.index_status()
    assert whole["blocks"] == 64 and whole["endpoints"] == 2 and whole["max_blocks"] == 10_000
    assert whole["bytes"] > 0 and whole["evicted"] == 0
    a, b = view.status(urls[0]), view.status(urls[1])
    assert a is not None and b is not None
    assert a["index_bytes"] > b["index_bytes"] > 0 and a["cap_blocks"] == 5000 and a["evicted"] == 0
    metrics = RouterMetrics(list)
    metrics.register(IndexCollector(view.index))
    text = metrics.render().decode()
    assert f"lbd_router_kv_index_bytes {float(estimate(view.index).bytes)}" in text
    assert "lbd_router_kv_index_max_blocks 10000.0" in text
    assert "lbd_router_kv_index_evicted_blocks_total 0.0" in text
    await view.close()
