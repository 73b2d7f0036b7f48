"""`lbd serve`: one engine rank, or (``--data-parallel-size N`` without ``--data-parallel-rank``) this node's
part of a data-parallel deployment (see lbd/serve/__init__.py for the topologies).

Exit codes: 0 after SIGTERM/SIGINT; 2 on a bad command line (one line on stderr, nothing started, no port
left bound), when the head refuses this node, or when a rank cannot start for a usage error; 1 (or the
supervisor's code) when the node's supervisor gave up.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys

from lbd.common.cluster import listen_socket
from lbd.serve.plan import PROG, Plan, parse
from lbd.supervisor.config import bind_health_socket
from lbd.supervisor.flags import SupervisorArgError


def _setup_logging(plan: Plan) -> None:
    handler = logging.StreamHandler(sys.stderr)
    where = f"ranks {plan.dp_start_rank}+{plan.dp_size_local}" if plan.dp_size_local else "router only"
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)s serve[{plan.role} {where}] %(message)s"))
    logger = logging.getLogger("lbd.serve")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _bind(plan: Plan) -> tuple[socket.socket, socket.socket | None]:
    """The health port and (head) the registration port, bound now so nothing takes them later."""
    health = bind_health_socket(plan.health_host, plan.health_port)
    if not plan.registry:
        return health, None
    assert plan.address is not None
    try:  # the head's address only: the registration port is no wider than the group needs
        rpc = listen_socket(plan.address, plan.rpc_port)
    except OSError as e:
        health.close()
        if e.errno == errno.EADDRINUSE:
            raise SupervisorArgError(f"--data-parallel-rpc-port {plan.rpc_port} is already in use: pick a "
                                     "free port (and pass the same to every node)") from None
        raise SupervisorArgError(f"--data-parallel-address {plan.address}: the head cannot listen there "
                                 f"({e.strerror or e}): give the head's own address on the network its "
                                 "nodes share") from None
    rpc.setblocking(False)
    return health, rpc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = parse(argv)
    if plan is None:
        from lbd.engine.launch import main as serve_one_rank

        return serve_one_rank(argv)
    try:
        health, rpc = _bind(plan)
    except SupervisorArgError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    _setup_logging(plan)
    import uvloop

    from lbd.serve.node import DeploymentNode

    return uvloop.run(DeploymentNode(plan, health, rpc).run())
