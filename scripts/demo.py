"""The main job on one machine: a supervised node of DP ranks of the default model behind `lbd route`.

Starts `lbd supervise` (2 ranks by default), waits for its readiness, starts `lbd route` over the node's
supervisor, asks one question through the router with the openai SDK, prints the answer, then keeps serving
until Ctrl-C (or exits at once with --once). Every process it starts stops with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"demo: {p.args[2]} exited with {p.returncode} before {url} was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"demo: {url} not ready after {timeout:.0f} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2, help="DP ranks on this node")
    p.add_argument("--rank-port", type=int, default=8000, help="first rank's port (rank i: +i)")
    p.add_argument("--supervisor-port", type=int, default=9256)
    p.add_argument("--router-port", type=int, default=8080)
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--once", action="store_true", help="exit after answering")
    args = p.parse_args()
    lbd = [sys.executable, "-m", "lbd"]
    host = "127.0.0.1"
    supervise = lbd + ["supervise", "--data-parallel-multi-port-external-lb",
                       "--data-parallel-size", str(args.ranks), "--data-parallel-size-local", str(args.ranks),
                       "--host", host, "--port", str(args.rank_port),
                       "--data-parallel-supervisor-port", str(args.supervisor_port),
                       "--dp-supervisor-probe-interval-s", "1"]
    route = lbd + ["route", "--upstreams", f"supervisor://{host}:{args.supervisor_port}",
                   "--host", host, "--port", str(args.router_port)]
    procs = [subprocess.Popen(supervise, start_new_session=True)]
    try:
        print(f"demo: starting {args.ranks} ranks under lbd supervise (health port {args.supervisor_port})")
        wait_ready(f"http://{host}:{args.supervisor_port}/readyz", procs, timeout=600)
        procs.append(subprocess.Popen(route, start_new_session=True))
        wait_ready(f"http://{host}:{args.router_port}/readyz", procs, timeout=60)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://{host}:{args.router_port}/v1", api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.question}], max_tokens=64, temperature=0)
        print(f"\nQ: {args.question}\nA: {reply.choices[0].message.content}\n")
        if args.once:
            return 0
        print(f"demo: serving; OpenAI base URL http://{host}:{args.router_port}/v1 (Ctrl-C stops)")
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
        return 0
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(45)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
