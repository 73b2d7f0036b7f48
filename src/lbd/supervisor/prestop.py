"""``python -m lbd.supervisor.prestop``: a node pod's Kubernetes ``preStop`` hook, the drain-and-move path a
scale-down (KEDA, an HPA, ``kubectl scale``) takes (docker/k8s/base/node.yaml).

1. Every local rank still serving is drained (``POST /ranks/{rank}/drain`` on the health port, with
   ``$LBD_ADMIN_TOKEN``): it turns ``draining`` in /status, so routers following the node (``supervisor://``)
   send it nothing new, and its in-flight requests go on.
2. It waits ``--settle-s`` (longer than the routers' --supervisor-poll-interval-s) so every router has read
   that, then returns; the kubelet then sends SIGTERM.
3. On SIGTERM the supervisor gives each rank ``--shutdown-timeout`` to finish what it runs; streams still
   running after that are cut, and the router resumes each one on a rank that stays (lbd.router.migration),
   so the client sees one whole stream.

The drain is the admin one, which restarts a rank once it is idle: a rank that finishes its work and
starts again within ``--settle-s`` (an engine's start takes longer) would take requests again until SIGTERM,
and those are finished or resumed like any other; nothing is lost, but a node-wide drain without restart
(``retire``, as ``POST /scale`` does for the ranks it removes) would be tidier.

The pod's ``terminationGracePeriodSeconds`` must cover settle + ``--shutdown-timeout`` + 5 s (the test of
the manifests checks it). The hook never fails the pod's termination: a node it cannot reach (already
stopping) or a refused drain is reported on stderr and it exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request

from lbd.supervisor.flags import ADMIN_TOKEN_ENV
from lbd.wire.states import RankState
from lbd.wire.status import decode_supervisor_status

MAX_STATUS_BYTES = 4 * 1024 * 1024


def _call(url: str, token: str | None, method: str = "GET") -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        return resp.read(MAX_STATUS_BYTES)


def drain_node(node: str, token: str | None) -> list[int]:
    """Drain every rank of the node at ``node`` that is not draining yet; the ranks asked."""
    status = decode_supervisor_status(_call(node + "/status", token))
    asked = []
    for r in status.ranks:
        if r.rank is None or r.state in (RankState.DRAINING, RankState.STOPPED, RankState.FAILED):
            continue
        try:
            _call(f"{node}/ranks/{r.rank}/drain", token, "POST")
            asked.append(r.rank)
        except urllib.error.HTTPError as e:  # 409: busy with another command; the SIGTERM path still runs
            print(f"prestop: rank {r.rank}: drain answered {e.code}", file=sys.stderr)
    return asked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The hook's flags; exit 2 naming the flag on a bad one."""
    p = argparse.ArgumentParser(prog="python -m lbd.supervisor.prestop", description=__doc__.split("\n")[0])
    p.add_argument("--node", default="http://127.0.0.1:9256", help="the node's health port")
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="wait this long after the drains, so every router has read them")
    ns = p.parse_args(argv)
    if ns.settle_s < 0:
        p.error(f"--settle-s must be >= 0, got {ns.settle_s}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        asked = drain_node(ns.node.rstrip("/"), os.environ.get(ADMIN_TOKEN_ENV) or None)
    except (OSError, ValueError) as e:  # unreachable, or not a supervisor's /status: nothing to drain here
        print(f"prestop: {ns.node}: {e}", file=sys.stderr)
        return 0
    print(f"prestop: draining ranks {asked}; waiting {ns.settle_s:g} s for the routers", file=sys.stderr)
    time.sleep(ns.settle_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
