"""``supervisor+dns://name:port``: follow every address a DNS name resolves to as a supervisor.

Made for a Kubernetes headless Service in front of a StatefulSet of `lbd supervise` pods: its name resolves to
one A (or AAAA) record per pod, so nodes that are added, replaced or removed are found without a router
restart. The name is resolved again every ``--dns-refresh-interval-s``; a new address gets its own
``supervisor://address:port`` follower, an address that is gone has its follower stopped and its ranks
removed. A failed lookup keeps the last known set (a DNS hiccup must not empty the router); each follower
already keeps an unreachable supervisor's last known ranks, and the router's own probes eject dead ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from lbd.router.config import Upstream

log = logging.getLogger("lbd.router")


def supervisor_url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


async def resolve(host: str, port: int) -> set[str]:
    """Every address of ``host`` (raises OSError when the lookup fails)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {str(info[4][0]) for info in infos}


async def follow_dns(up: Upstream, interval_s: float, follow: Callable[[Upstream], asyncio.Task[None]],
                     forget: Callable[[str], None]) -> None:
    """Keep one ``follow``ed supervisor per address of ``up``'s name; ``forget(url)`` drops a gone one's
    ranks."""
    parts = urlsplit(up.url)
    host, port = parts.hostname or "", parts.port or 9256
    followed: dict[str, asyncio.Task[None]] = {}
    failing = False
    try:
        while True:
            try:
                addresses = await resolve(host, port)
            except OSError as e:
                if not failing:
                    log.warning("supervisor+dns://%s:%d: lookup failed (%s); keeping %d known supervisors",
                                host, port, e, len(followed))
                failing = True
            else:
                failing = False
                for address in sorted(addresses - followed.keys()):
                    url = supervisor_url(address, port)
                    log.info("supervisor+dns://%s:%d: following %s", host, port, url)
                    followed[address] = follow(Upstream("supervisor", url))
                for address in sorted(followed.keys() - addresses):
                    url = supervisor_url(address, port)
                    log.info("supervisor+dns://%s:%d: %s is gone; dropping its ranks", host, port, url)
                    task = followed.pop(address)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    forget(url)
            await asyncio.sleep(interval_s)
    finally:
        for task in followed.values():
            task.cancel()
