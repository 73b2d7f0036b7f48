"""Helpers of the MoE DP-group tests: a coordinator and rank cores as real processes, and a ZMQ front end."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq

from lbd.wire import core_messages as CM
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams
from lbd.wire.dp_messages import CoordinatorMessage, RankMessage, decode_from_coordinator, encode
from support import free_port_run, spawn, stop, wait_http
from support.parity import Run


class Group:
    """The coordinator's ports of one test group (P itself is unused: lbd serve's registration port)."""

    def __init__(self, size: int, tmp: Path) -> None:
        self.size = size
        self.rpc_port = free_port_run(4)
        self.http = f"http://127.0.0.1:{self.rpc_port + 3}"
        self.tmp = tmp

    def flags(self, rank: int) -> list[str]:
        return ["--data-parallel-size", str(self.size), "--data-parallel-rank", str(rank),
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(self.rpc_port)]

    def start_coordinator(self) -> object:
        argv = [sys.executable, "-m", "lbd.engine.dp.coordinator", "--data-parallel-size", str(self.size),
                "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(self.rpc_port)]
        self.coord = spawn(argv, log=self.tmp / "coordinator.log")
        wait_http(self.http + "/status", timeout=60, proc=self.coord)
        return self.coord

    @contextlib.contextmanager
    def coordinator(self) -> Iterator[object]:
        """The coordinator for the block (``start_coordinator`` replaces it; the last one is stopped)."""
        try:
            yield self.start_coordinator()
        finally:
            stop(self.coord)

    def start_core(self, model: Path, rank: int, *flags: str) -> tuple[object, str]:
        """A bare core process of ``rank`` (no HTTP front end): (process, its ZMQ address)."""
        address = f"ipc://{self.tmp}/core{rank}-{time.monotonic_ns()}.sock"
        proc = spawn([sys.executable, "-m", "lbd.engine.rank_core", "--model-path", str(model),
                      "--input-address", address, "--kv-cache-memory-bytes", "16MiB",
                      "--max-model-len", "256", "--log-level", "warning", *self.flags(rank), *flags],
                     log=self.tmp / f"core{rank}.log")
        return proc, address


class CoreConn:
    """A front end in the test: a DEALER on a core's ROUTER (the engine's own protocol)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.dp: dict | None = None
        self.runs: dict[str, Run] = {}
        self.finished: set[str] = set()
        self.errors: dict[str, tuple[int, str]] = {}
        self._ready = False

    def hello(self, timeout: float = 120.0) -> None:
        self.sock.send_multipart([CM.HELLO, CM.encode(CM.Hello())])
        self._until(lambda: self._ready, timeout, "ready")

    def add(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.runs[rid] = Run()
        self.sock.send_multipart([CM.ADD, CM.encode(EngineCoreRequest(rid, prompt, sampling, None, 0.0))])

    def wait_done(self, ids: list[str], timeout: float = 120.0) -> None:
        self._until(lambda: all(i in self.finished or i in self.errors for i in ids), timeout, "requests")

    def wait_tokens(self, rid: str, n: int, timeout: float = 60.0) -> None:
        self._until(lambda: len(self.runs[rid].tokens) >= n or rid in self.errors, timeout, "tokens")

    def wait_dp(self, pred: Callable[[dict], bool], timeout: float = 120.0) -> dict:
        self._until(lambda: self.dp is not None and pred(self.dp), timeout, "DP status")
        assert self.dp is not None
        return self.dp

    def _until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {timeout}s (dp={self.dp})")
            if self.sock.poll(min(left, 0.2) * 1000):
                self._handle(self.sock.recv_multipart())

    def _handle(self, frames: list[bytes]) -> None:
        kind, payload = frames[0], frames[1] if len(frames) > 1 else b""
        if kind == CM.READY:
            self._ready = True
        elif kind == CM.DP:
            self.dp = dataclasses.asdict(CM.decode(kind, payload))
        elif kind == CM.ERROR:
            msg = CM.decode(kind, payload)
            self.errors[msg.request_id] = (msg.status, msg.message)
        elif kind == CM.OUTPUTS:
            for out in CM.decode(kind, payload).outputs:
                run = self.runs[out.request_id]
                run.tokens += out.new_token_ids
                for lp in out.new_logprobs or []:
                    run.top.append(dict(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                    run.chosen.append(lp.token_logprob)
                if out.finish_reason is not None:
                    self.finished.add(out.request_id)

    def close(self) -> None:
        self.sock.close(linger=0)


class RankConn:
    """A stand-in for a rank's core on the coordinator's ZMQ port (A:P+2): sends rank messages (or raw
    bytes, as a buggy or newer peer would) and reads the coordinator's answers."""

    def __init__(self, group: Group) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{group.rpc_port + 2}")

    def send(self, msg: RankMessage | bytes) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else encode(msg))

    def recv(self, timeout: float = 10.0) -> CoordinatorMessage | None:
        """The coordinator's next message, or None when none came within ``timeout``."""
        if not self.sock.poll(timeout * 1000):
            return None
        return decode_from_coordinator(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
