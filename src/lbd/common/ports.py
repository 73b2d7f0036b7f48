"""Can this process bind a port? The start-up check every program runs before it spawns anything, so a
taken port is an exit 2 naming the flag, not a child that dies later."""

from __future__ import annotations

import socket


def port_in_use(host: str | None, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (None when it can); the test socket is closed at once."""
    bind = host if host not in (None, "") else "0.0.0.0"
    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve {bind!r} ({e})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too: a port in TIME_WAIT is no conflict, a listening one is.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return f"port {port} on {bind} is already in use ({e.strerror})"
    return None
