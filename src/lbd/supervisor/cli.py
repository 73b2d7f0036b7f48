"""`lbd supervise`: run this node's DP ranks, each an engine server on its own port, behind one health port.

Exit codes: 0 after SIGTERM/SIGINT (every rank stopped), 1 when a rank failed under --on-rank-failure exit,
2 on a bad command line (one line on stderr; nothing started, no port left bound) and when a rank exits with
code 2 before it was ever ready (an engine usage error such as a model that does not exist).
"""

from __future__ import annotations

import logging
import socket
import sys

from lbd.supervisor.config import SupervisorConfig, bind_health_socket, parse_args
from lbd.supervisor.flags import PROG, SupervisorArgError


def _setup_logging(node_rank: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s supervisor[node {node_rank}] %(message)s"))
    logger = logging.getLogger("lbd.supervisor")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        sock = bind_health_socket(cfg.supervisor_host, cfg.supervisor_port)
    except SupervisorArgError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    _setup_logging(cfg.node_rank)
    import uvloop

    from lbd.supervisor.health import HealthServer
    from lbd.supervisor.node import Supervisor

    if cfg.backend == "ray":
        return _run_on_ray(cfg, sock)
    node = Supervisor(cfg)  # here (and in _run_on_ray) the node and its health port meet
    return uvloop.run(node.run(HealthServer(node), sock))


def _run_on_ray(cfg: SupervisorConfig, sock: socket.socket) -> int:
    """Place the group on the Ray cluster first (exit 2 if it cannot hold it), then supervise as usual."""
    import asyncio

    from lbd.supervisor.node import Supervisor
    from lbd.supervisor.ray_rank import PlacementError, RayPlacement

    placement = RayPlacement(cfg)
    try:
        try:
            placement.setup()
        except PlacementError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
        # asyncio's own loop: Ray's futures are driven from its threads through call_soon_threadsafe
        from lbd.supervisor.health import HealthServer

        node = Supervisor(cfg, placement.start)
        return asyncio.run(node.run(HealthServer(node), sock))
    finally:
        placement.close()


if __name__ == "__main__":
    sys.exit(main())
