"""Under `lbd serve` with a cluster token, the router follows the ranks' CURVE-secured load streams (lbd
serve hands it the token by environment): a head and a headless node in two network namespaces, and every
rank, remote ones included, is pushed, not scraped (``telemetry_push`` in /router/status)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from support.deploy_harness import PROBE_FLAGS, SIM_FLAGS, ServeNode
from support.netns import Namespaces, unavailable

HEAD, WORKER = "10.77.1.1", "10.77.1.2"
TOKEN = {"LBD_CLUSTER_TOKEN": "pushed-1SvS2ZfY0w2vJtq3o8uKj2yTQ4R5Gq9rHk3sVbN7xWc"}

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")


@pytest.fixture
def nodes() -> Iterator[tuple[Namespaces, str, str]]:
    nets = Namespaces()
    try:
        head, worker = nets.add("ph"), nets.add("pw")
        nets.link(head, HEAD, worker, WORKER)
        yield nets, head, worker
    finally:
        nets.close()


def test_remote_ranks_are_pushed_over_curve(nodes: tuple[Namespaces, str, str], tiny_llama: Path,
                                            tmp_path: Path) -> None:
    nets, head_ns, worker_ns = nodes
    flags = ["--model", str(tiny_llama), *SIM_FLAGS, *PROBE_FLAGS, "--data-parallel-size", "2",
             "--data-parallel-size-local", "1", "--data-parallel-address", HEAD,
             "--data-parallel-rpc-port", "29551"]
    head = ServeNode(flags, tmp_path / "head.log", nets, head_ns, host=HEAD, env=TOKEN)
    worker = ServeNode([*flags, "--headless", "--data-parallel-start-rank", "1"], tmp_path / "worker.log",
                       nets, worker_ns, host=WORKER, env=TOKEN)
    try:
        head.wait_ready()

        def pushed() -> dict[int, dict]:
            return {e["rank"]: e["telemetry_push"] for e in head.router_status()["endpoints"]
                    if e["telemetry_push"] and e["telemetry_push"]["state"] == "pushed"}

        head.wait_for(lambda: sorted(pushed()) == [0, 1], 30, "both ranks' load streams followed")
        streams = {rank: entry["stream"] for rank, entry in pushed().items()}
        assert streams[1].startswith(f"tcp://{WORKER}:") and streams[0].startswith(f"tcp://{HEAD}:"), streams
        assert TOKEN["LBD_CLUSTER_TOKEN"] not in head.log_text() + worker.log_text()
    finally:
        codes = worker.close(), head.close()
    assert codes == (0, 0), head.log_text()[-3000:] + worker.log_text()[-3000:]
