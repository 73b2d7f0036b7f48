"""The router's own CPU per request, in one process, without sockets: the real front-side protocol
(lbd.router.server), proxy, policy and upstream client (lbd.router.upstream) over in-memory transports that
answer at once. What is left is the Python the router runs per request; syscalls and the kernel's TCP are
measured by benchmarks/router_overhead.py. CPU time (not wall time), so a shared machine disturbs it less;
the table shows the least of --runs runs.

    .venv/bin/python benchmarks/router_cpu.py [--requests 30000] [--runs 5] [--headers sdk]
    PYTHONPATH=/other/checkout .venv/bin/python benchmarks/router_cpu.py   # the same for another tree
    .venv/bin/python benchmarks/router_cpu.py --instructions   # machine instructions, under valgrind

``--instructions`` counts what the CPU executes instead of timing it, so other work on the machine does not
move the figure: each case runs under valgrind's callgrind with 500 and with 2,500 requests (PYTHONHASHSEED
fixed), and the difference over 2,000 is the instructions a request costs (start-up cancels out).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if not os.environ.get("PYTHONPATH"):  # else the tree PYTHONPATH names is measured
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from http_load import ANSWER, large_body, small_body  # noqa: E402
from lbd.router import server as front  # noqa: E402
from lbd.router import upstream as back  # noqa: E402
from lbd.router.config import parse_args  # noqa: E402
from lbd.router.proxy import Proxy  # noqa: E402
from lbd.router.shared import SharedCounters  # noqa: E402
from lbd.router.state import RouterState  # noqa: E402

CONCURRENCY = 64
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(ANSWER)) + ANSWER
# what the openai SDK sends besides Host, Content-Type and Content-Length
SDK_HEADERS = (b"Accept: application/json\r\nAccept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
               b"User-Agent: OpenAI/Python 1.99.0\r\nX-Stainless-Lang: python\r\n"
               b"X-Stainless-Package-Version: 1.99.0\r\nX-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\n"
               b"X-Stainless-Runtime: CPython\r\nX-Stainless-Runtime-Version: 3.11.7\r\n"
               b"Authorization: Bearer sk-none\r\nX-Stainless-Retry-Count: 0\r\n")


class MemoryTransport(asyncio.Transport):
    def __init__(self, on_write) -> None:
        super().__init__()
        self.on_write, self.closing = on_write, False

    def write(self, data: bytes) -> None:
        self.on_write(data)

    def writelines(self, parts) -> None:
        self.on_write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    abort = close

    def pause_reading(self) -> None:
        pass

    resume_reading = pause_reading

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


async def cpu_per_request(policy: str, body: bytes, headers: bytes, requests: int, traced: bool) -> float:
    loop = asyncio.get_running_loop()
    argv = ["--upstreams", "http://127.0.0.1:1,http://127.0.0.1:2", "--policy", policy]
    state = RouterState(parse_args(argv), SharedCounters(1))
    for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"):
        state.add(url, "static")
    tracer = None
    if traced:
        from lbd.router.tracing import RouterTracer

        tracer = RouterTracer("http://127.0.0.1:9")  # nothing listens: spans are made, exports fail quietly
    proxy = Proxy(state, tracer=tracer) if tracer is not None else Proxy(state)  # older trees: no tracer

    async def connect(pool: back.UpstreamPool) -> back._Conn:
        conn = back._Conn(pool)
        conn.connection_made(MemoryTransport(lambda _data: loop.call_soon(conn.data_received, RESPONSE)))
        return conn

    for pool in state.pools.values():
        pool._connect = lambda pool=pool: connect(pool)
    server = front.HttpServer(proxy.handle, getattr(state.cfg, "limits", 1 << 26))  # older trees: a body cap
    connection_class = getattr(front, "_Connection", None) or front.Connection  # older trees: in server.py
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:1\r\n" + headers
               + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    done = 0
    finished = loop.create_future()

    def client() -> None:
        conn = connection_class(server)
        buf = bytearray()

        def on_write(data: bytes) -> None:
            nonlocal done
            buf.extend(data)
            if buf.endswith(ANSWER):
                buf.clear()
                done += 1
                if done >= requests:
                    if not finished.done():
                        finished.set_result(None)
                    return
                loop.call_soon(conn.data_received, request)

        conn.connection_made(MemoryTransport(on_write))
        conn.data_received(request)

    t0 = time.process_time()
    for _ in range(CONCURRENCY):
        client()
    await finished
    return (time.process_time() - t0) / done


def instructions(case: int, requests: int, headers: str) -> int:
    """Instructions callgrind counts for a whole run of one case (start-up included)."""
    argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__,
            "--only", str(case), "--requests", str(requests), "--runs", "1", "--headers", headers]
    run = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"},
                         check=True)
    return int(re.search(r"Collected : (\d+)", run.stderr).group(1))


def print_instructions(cases: list, headers: str) -> int:
    print("| policy | body | instructions / request |\n|---|---|---:|")
    for i, (policy, what, _body, traced) in enumerate(cases):
        if traced:  # spans are exported from a thread: its work does not scale with the request count
            continue
        per = (instructions(i, 2500, headers) - instructions(i, 500, headers)) / 2000
        print(f"| {policy} | {what} | {per:,.0f} |")
    return 0


def main() -> int:
    import uvloop

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=30000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--headers", choices=["wrk", "sdk"], default="sdk",
                   help="the client's header set: wrk's three, or the openai SDK's fifteen")
    p.add_argument("--only", type=int, default=None, help="run only the case with this index (0-5)")
    p.add_argument("--instructions", action="store_true",
                   help="instructions per request under valgrind's callgrind instead of CPU time")
    args = p.parse_args()
    headers = SDK_HEADERS if args.headers == "sdk" else b""
    cases = [("round_robin", "80 B", small_body(), False), ("round_robin", "16 KiB", large_body(), False),
             ("prefix_affinity", "80 B", small_body(), False),
             ("prefix_affinity", "16 KiB", large_body(), False),
             ("predicted_ttft", "80 B", small_body(), False),
             ("round_robin", "80 B, traced", small_body(), True)]
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}; {args.headers} headers; least of "
          f"{args.runs} runs of {args.requests} requests\n")
    if args.instructions:
        return print_instructions(cases, args.headers)
    print("| policy | body | router CPU us / request |\n|---|---|---:|")
    for i, (policy, what, body, traced) in enumerate(cases):
        if traced and importlib.util.find_spec("lbd.router.tracing") is None:
            continue
        if args.only is not None and i != args.only:
            continue
        best = min(uvloop.run(cpu_per_request(policy, body, headers, args.requests, traced))
                   for _ in range(args.runs))
        print(f"| {policy} | {what} | {best * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
