"""A stand-in for a flaky network link: a loopback TCP forwarder (one thread, in the test process) whose
``reset()`` cuts every connection through it with a TCP reset (SO_LINGER 0), as a broken link or a
middlebox would. New connections are taken again at once (the link is back).

One thread owns every socket: a socket closed while another thread is blocked reading it is not released
(nor reset) until that read returns."""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

from support.procs import free_port


class LinkCut:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._peer: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut_asked = 0
        self._cut_done = threading.Condition(self._lock)
        self._cut_count: list[int] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"linkcut-{self.port}")
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select(0.02):
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._forward(key.fileobj)  # type: ignore[arg-type]
            with self._lock:
                if self._cut_asked:
                    self._cut_asked = 0
                    self._cut_count.append(self._cut_all())
                    self._cut_done.notify_all()
        self._cut_all()
        self._listener.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
        except OSError:
            _rst(client)
            return
        for s in (client, upstream):
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, None)
        self._peer[client], self._peer[upstream] = upstream, client

    def _forward(self, src: socket.socket) -> None:
        dst = self._peer.get(src)
        if dst is None:
            return
        try:
            data = src.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(src)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
            return
        try:
            dst.setblocking(True)
            dst.sendall(data)
            dst.setblocking(False)
        except OSError:
            self._drop(src)
            self._drop(dst)

    def _drop(self, s: socket.socket) -> None:
        if self._peer.pop(s, None) is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(s)
            _rst(s)

    def _cut_all(self) -> int:
        socks = list(self._peer)
        for s in socks:
            self._drop(s)
        return len(socks)

    def reset(self) -> int:
        """Cut every open connection with a reset; returns how many sockets were cut."""
        with self._lock:
            self._cut_asked = 1
            n = len(self._cut_count)
            self._cut_done.wait_for(lambda: len(self._cut_count) > n, timeout=5)
            return self._cut_count[-1]

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)


def _rst(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.close()
