"""A stand-in for a link that breaks at an exact point of a stream: a loopback TCP forwarder (threads, in the
test process) that passes everything on until it is armed; then the next event stream (``text/event-stream``
answer) through it is cut with a TCP reset right after a chosen SSE event: the ``after``-th event, or the one
that carries a finish reason (``"finish_reason":"``). What was before the cut reaches the peer whole, nothing
after it. A kill of the rank cannot be timed that precisely (the rank writes its last events together). One
``Cut`` armed on several links cuts one stream: the first that starts through any of them.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

from support.procs import free_port

_FINISH = b'"finish_reason":"'


class Cut:
    """Where to cut (see the module); taken once, by the first event stream that claims it."""

    def __init__(self, after: int | None = None, finish: bool = False) -> None:
        self.after, self.finish = after, finish
        self._lock = threading.Lock()
        self._taken = False

    def take(self) -> bool:
        with self._lock:
            taken, self._taken = self._taken, True
        return not taken


class SseCut:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; ``arm`` cuts the next event stream."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._lock = threading.Lock()
        self._armed: Cut | None = None
        self.cuts = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name=f"ssecut-{self.port}").start()

    def arm(self, cut: Cut) -> None:
        """Cut the next event stream (unless another link took ``cut`` first)."""
        with self._lock:
            self._armed = cut

    def disarm(self) -> None:
        with self._lock:
            self._armed = None

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                _reset(client)
                continue
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answers, args=(upstream, client), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def _claim(self, head: bytes) -> Cut | None:
        if b"text/event-stream" not in head:
            return None
        with self._lock:
            armed, self._armed = self._armed, None
        return armed if armed is not None and armed.take() else None

    def _answers(self, upstream: socket.socket, client: socket.socket) -> None:
        """Upstream to client; an armed event stream is cut at its point."""
        plan: Cut | None = None
        seen = b""  # the claimed stream's bytes so far
        pending = b""  # an answer's head until it is whole
        try:
            while data := upstream.recv(65536):
                if plan is None:
                    pending += data
                    end = pending.find(b"\r\n\r\n")
                    if end < 0 or not pending.startswith(b"HTTP/"):
                        if not pending.startswith(b"HTTP/") or len(pending) > 1 << 16:
                            pending = b""  # (a body's bytes, or a head too long to be an answer's)
                        client.sendall(data)
                        continue
                    plan = self._claim(pending[:end])
                    if plan is None:
                        pending = b""
                        client.sendall(data)
                        continue
                    start = len(data) - (len(pending) - end - 4)
                    client.sendall(data[:start])
                    data, pending = data[start:], b""
                seen += data
                cut = _cut_point(seen, plan.after, plan.finish)
                if cut is None:
                    client.sendall(data)
                    continue
                client.sendall(data[: len(data) - (len(seen) - cut)])
                self.cuts += 1
                break
        except OSError:
            pass
        _reset(client)
        with contextlib.suppress(OSError):
            upstream.shutdown(socket.SHUT_RDWR)
        upstream.close()


def _cut_point(seen: bytes, after: int | None, finish: bool) -> int | None:
    """Where the claimed stream is cut (the end of its chosen event), once it has arrived."""
    if finish:
        at = seen.find(_FINISH)
        end = seen.find(b"\n\n", at) if at >= 0 else -1
        return end + 2 if end >= 0 else None
    if after is None:
        return None
    pos = 0
    for _ in range(after):
        end = seen.find(b"\n\n", pos)
        if end < 0:
            return None
        pos = end + 2
    return pos


def _reset(sock: socket.socket) -> None:
    """Reset ``sock``; shut down first: a close alone waits for the other thread's blocked read of it."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
