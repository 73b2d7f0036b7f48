"""Every listening TCP socket of a deployment's process trees, and the check that none is beyond loopback
unless a flag asked for it. Shared by the tests that start a topology for another reason too (readiness,
joining), so one start of each topology checks both."""

from __future__ import annotations

import ipaddress

import psutil


def listeners(*roots: int) -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket of these process trees."""
    out = []
    for root in roots:
        top = psutil.Process(root)
        for proc in [top, *top.children(recursive=True)]:
            try:
                conns = proc.net_connections("inet")
                name = " ".join(proc.cmdline()[1:4])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def assert_closed(found: list[tuple[str, int, str]], asked: set[int], expect: int) -> None:
    """Only the ``asked`` ports may listen beyond loopback; at least ``expect`` sockets were seen (so a tree
    that was walked too early does not pass for a closed one)."""
    wide = [(ip, port, name) for ip, port, name in found if not loopback(ip) and port not in asked]
    assert not wide, f"listening beyond loopback without a flag asking: {wide}\nall: {sorted(found)}"
    assert len(found) >= expect, sorted(found)
