"""Router overhead on 2,000-token chat prompts (issue 13): each request a new user turn on one history,
through `lbd route` with the stub engines' real KV-event publishers (exact view: tokenize, hash, index) and
with `--kv-events off`, and through the peers (round robin: they neither tokenize nor index). Closed-loop
load at concurrency 1 and 64 against raw uvloop stubs, direct and through each router, rounds interleaved,
medians. The equal-policy small/16 KiB/streamed rows are `benchmarks/router_overhead.py`; this script keeps
its own stubs because they must serve a tokenizer and publish KV events.

    .venv/bin/python benchmarks/router_overhead_chat.py [--seconds 3] [--rounds 3] [--only lbd] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from http_load import (  # noqa: E402,F401
    ANSWER,
    Load,
    _http,
    _stub_metrics,
    _wrk_us,
    closed_loop,
    post_request,
    run_wrk,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from peers import PEER_KINDS, lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from router_overhead import _median, free_port, nginx_conf, start, stop, wait_port  # noqa: E402
from support.procs import exit_on_sigterm, tree_usage  # noqa: E402

BODY = b'{"model": "stub-model", "prompt": "Say hello to the router benchmark.", "max_tokens": 1}'


# ---- stub upstream (raw uvloop protocol) -------------------------------------------------------------


class _StubProtocol(asyncio.Protocol):
    def __init__(self, answers: dict[bytes, bytes]) -> None:
        self.answers = answers
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            length = (
                int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
                if i >= 0
                else 0
            )
            if len(self.buf) < end + 4 + length:
                return
            path = head.split(b" ", 2)[1].split(b"?")[0]
            self.buf = self.buf[end + 4 + length :]
            self.transport.write(self.answers.get(path, self.answers[b"*"]))  # type: ignore[attr-defined]


def run_stub(port: int, rank: int, chat_fixture: str | None = None) -> None:
    """A stub engine; with ``chat_fixture`` it also serves a tokenizer and publishes KV events."""
    import uvloop

    answers = {
        b"/metrics": _http(b"200 OK", _stub_metrics(rank), b"text/plain"),
        b"/health": _http(b"200 OK", b""),
        b"/v1/models": _http(b"200 OK", b'{"object":"list","data":[{"id":"stub-model","object":"model"}]}'),
        b"*": _http(b"200 OK", ANSWER),
    }
    if chat_fixture:
        from chat_stub import stub_answers

        extra, _publisher = stub_answers(chat_fixture, _http)  # the publisher lives as long as the stub
        answers.update(extra)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _StubProtocol(answers), "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    uvloop.run(main())


# ---- load generators --------------------------------------------------------------------------------


def run_pyload(
    url: str, conc: int, seconds: float, chat_fixture: str | None = None, cold: bool = False
) -> None:
    """Closed loop in this process (used via a subprocess); prints one JSON line."""
    import itertools

    host, port = url.split("//")[1].split(":")
    path, make_body = "/v1/completions", lambda: BODY
    if chat_fixture:
        from chat_stub import body

        fixture, counter = json.loads(Path(chat_fixture).read_text()), itertools.count(1)
        tag = f"{os.getpid()}.{time.time_ns()}."  # unique across runs (see chat_stub.wrk_script)
        path, make_body = "/v1/chat/completions", lambda: body(fixture, f"{tag}{next(counter)}", cold)
    request = lambda: post_request(host, port, path, make_body())  # noqa: E731
    print(json.dumps(closed_loop(host, int(port), conc, seconds, request)))


def make_loader(
    seconds: float, tmp: Path, chat_fixture: Path | None = None, cold: bool = False
) -> Callable[[str, int], Load]:
    if shutil.which("wrk"):
        if chat_fixture is not None:
            from chat_stub import wrk_script

            script = wrk_script(json.loads(chat_fixture.read_text()), tmp / f"chat{'-cold' * cold}.lua", cold)
        else:
            script = tmp / "post.lua"
            script.write_text(
                'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                f"wrk.body = '{BODY.decode()}'\n"
            )
        return lambda url, conc: run_wrk(url, conc, seconds, script)

    def py(url: str, conc: int) -> Load:
        out = subprocess.run(
            [sys.executable, __file__, "--pyload", url, str(conc), str(seconds), str(chat_fixture or ""),
             "cold" if cold else ""],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        return Load(**json.loads(out.stdout.strip().splitlines()[-1]))

    return py


# ---- process helpers --------------------------------------------------------------------------------


# ---- routers ------------------------------------------------------------------------------------------
def router_commands(tmp: Path, ups: list[str]) -> dict[str, tuple[list[str], int, str]]:
    """name -> (argv, port, readiness path), only for routers installed here."""
    out: dict[str, tuple[list[str], int, str]] = {}
    for workers in (1, 2):
        port = free_port()
        argv, ready = lbd_route_argv(port, ",".join(ups), "--workers", str(workers))
        out[f"lbd route ({workers} worker{'s' if workers > 1 else ''})"] = (argv, port, ready)
    for kind in PEER_KINDS:
        if peer_installed(kind):
            port = free_port()
            argv, ready = peer_argv(kind, port, ups, "round_robin")
            out[kind] = (argv, port, ready)
    if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
        port = free_port()
        out["nginx"] = (nginx_conf(tmp, port, ups), port, "/v1/models")
    return out


@dataclass
class Row:
    name: str
    c1_p50_us: float
    c1_p99_us: float
    over_p50_us: float
    over_p99_us: float
    c64_rps: float
    c64_p50_us: float
    c64_p99_us: float
    cpu_ms_per_1k: float
    rss_mib: float
    errors: int


def measure_all(
    cmds: dict[str, tuple[list[str], int, str]],
    direct_url: str,
    load: Callable[[str, int], Load],
    rounds: int,
    tmp: Path,
    when_ready: Callable[[], None] | None = None,
) -> tuple[Load, list[Row]]:
    """Start every router, then run interleaved rounds (direct, A, B, ..., again), so drifts in the machine's
    background load hit every router alike; the rows are medians over the rounds."""
    procs = {
        name: start(argv, tmp / f"{re.sub(r'[^a-z0-9]+', '-', name.lower())}.log")
        for name, (argv, _, _) in cmds.items()
    }
    try:
        live = {}
        for name, (_, port, ready) in cmds.items():
            if wait_port(port, ready) and procs[name].poll() is None:
                live[name] = f"http://127.0.0.1:{port}"
            else:
                print(f"  {name}: did not start (see {tmp})", file=sys.stderr)
        if when_ready is not None:
            when_ready()
        for url in live.values():
            load(url, 8)  # warm-up: connections, first scrapes
        runs: dict[str, list[tuple[Load, Load, float, int]]] = {name: [] for name in live}
        direct: list[Load] = []
        for i in range(rounds):
            print(f"  round {i + 1}/{rounds}", flush=True)
            direct.append(load(direct_url, 1))
            for name, url in live.items():
                c1 = load(url, 1)
                cpu0, _ = tree_usage(procs[name].pid)
                c64 = load(url, 64)
                cpu1, rss = tree_usage(procs[name].pid)
                runs[name].append((c1, c64, (cpu1 - cpu0) / max(1, c64.requests) * 1e6, rss))
        d = Load(
            sum(x.requests for x in direct),
            sum(x.seconds for x in direct),
            _median([x.p50_us for x in direct]),
            _median([x.p99_us for x in direct]),
            sum(x.errors for x in direct),
        )
        return d, [_row(name, r, d) for name, r in runs.items()]
    finally:
        for proc in procs.values():
            stop(proc)


def _row(name: str, runs: list[tuple[Load, Load, float, int]], d: Load) -> Row:
    p50 = _median([c1.p50_us for c1, _, _, _ in runs])
    p99 = _median([c1.p99_us for c1, _, _, _ in runs])
    return Row(
        name,
        p50,
        p99,
        p50 - d.p50_us,
        p99 - d.p99_us,
        _median([c.rps for _, c, _, _ in runs]),
        _median([c.p50_us for _, c, _, _ in runs]),
        _median([c.p99_us for _, c, _, _ in runs]),
        _median([cpu for _, _, cpu, _ in runs]),
        max(r for _, _, _, r in runs) / 2**20,
        sum(c1.errors + c.errors for c1, c, _, _ in runs),
    )


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="length of each closed-loop run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table shows medians")
    p.add_argument("--only", default="", help="comma-separated name prefixes to run (e.g. 'lbd,nginx')")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--parts", default="chat", help="small: the short completion; chat: 2,000-token "
                   "chat prompts through lbd with KV events (and without) and the peers, a new turn per "
                   "request, then a new system prompt per request (cold)")
    args = p.parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",")}
    if not parts or not parts <= {"small", "chat"}:
        p.error(f"--parts {args.parts!r}: give a comma list of small, chat")
    if args.seconds < 1 or args.rounds < 1:
        p.error("--seconds and --rounds must be >= 1 (the prompts' tags use the clock's second)")
    tmp = Path(tempfile.mkdtemp(prefix="lbd-router-bench-"))
    stubs = []
    try:
        ports = [free_port(), free_port()]
        stubs = [
            start([sys.executable, __file__, "--stub", str(port), str(i)], tmp / f"stub{i}.log")
            for i, port in enumerate(ports)
        ]
        ups = [f"http://127.0.0.1:{port}" for port in ports]
        for port in ports:
            wait_port(port, "/health")
        load = make_loader(args.seconds, tmp)
        gen = "wrk" if shutil.which("wrk") else "python raw-socket client"
        print(
            f"load generator: {gen}; {args.seconds:g} s per run, {args.rounds} interleaved rounds (medians); "
            f"2 raw uvloop stub upstreams; {os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f}"
        )
        load(ups[0], 8)
        direct64 = load(ups[0], 64)
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        cmds = {
            name: c
            for name, c in router_commands(tmp, ups).items()
            if not wanted or any(name.startswith(w) for w in wanted)
        }
        rows: list[Row] = []
        if "small" in parts:
            direct, rows = measure_all(cmds, ups[0], load, args.rounds, tmp)
            print(
                f"direct to one stub: c=1 p50 {direct.p50_us:.0f} us, p99 {direct.p99_us:.0f} us; c=64 "
                f"{direct64.rps:.0f} req/s; load average after {os.getloadavg()[0]:.1f}"
            )
            print_table(rows)
        if "chat" in parts:
            chat_rows, direct = chat_part(args, tmp, stubs, wanted)
            rows += chat_rows
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(
                json.dumps(
                    {
                        "direct_c1": asdict(direct),
                        "direct_c64_rps": direct64.rps,
                        "rows": [asdict(r) for r in rows],
                    },
                    indent=1,
                )
            )
    finally:
        for s in stubs:
            stop(s)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def chat_part(args: argparse.Namespace, tmp: Path, stubs: list, wanted: list[str]) -> tuple[list[Row], Load]:
    """2,000-token chat prompts, a new user turn each: lbd with KV events, lbd without, the peers."""
    from chat_stub import prepare
    from lbd.engine.config.model_files import converted_path, default_gguf

    fixture_path = tmp / "chat" / "fixture.json"
    fixture_path.parent.mkdir()
    fixture = prepare(str(converted_path(default_gguf())), fixture_path)
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        stubs.append(start([sys.executable, __file__, "--stub", str(port), str(i), str(fixture_path)],
                           tmp / f"chat-stub{i}.log"))
    ups = [f"http://127.0.0.1:{port}" for port in ports]
    for port in ports:
        wait_port(port, "/health")
    cmds: dict[str, tuple[list[str], int, str]] = {}
    for name, extra in (("lbd route, chat 2k, KV events", ()), ("lbd route, chat 2k, --kv-events off",
                                                                 ("--kv-events", "off"))):
        port = free_port()
        argv, ready = lbd_route_argv(port, ",".join(ups), *extra)
        cmds[name] = (argv, port, ready)
    for kind in PEER_KINDS:
        if peer_installed(kind):
            port = free_port()
            argv, ready = peer_argv(kind, port, ups, "round_robin")
            cmds[f"{kind}, chat 2k"] = (argv, port, ready)
    cmds = {n: c for n, c in cmds.items() if not wanted or any(n.startswith(w) for w in wanted)}
    load = make_loader(args.seconds, tmp, fixture_path)
    exact = [(n, port) for n, (_, port, _) in cmds.items() if "KV events" in n]
    direct, rows = measure_all(cmds, ups[0], load, args.rounds, tmp, lambda: _wait_exact(exact))
    print(
        f"\nchat, {fixture['prompt_tokens']}-token prompts ({len(fixture['block_tokens']) // 16} blocks "
        f"announced by the stubs' KV events), a new user turn per request: direct c=1 p50 "
        f"{direct.p50_us:.0f} us, p99 {direct.p99_us:.0f} us; load average after {os.getloadavg()[0]:.1f}"
    )
    print_table(rows)
    # Cold: a new system prompt per request (no engine holds any of it): lbd routes on its head and
    # tokenizes the rest after the dispatch (kv.cold); --kv-events off hashes text and does not tokenize.
    cold = {n.replace("chat 2k", "chat 2k cold"): c for n, c in cmds.items() if "kv-events off" not in n}
    cold_load = make_loader(args.seconds, tmp, fixture_path, cold=True)
    exact = [(n, port) for n, (_, port, _) in cold.items() if "KV events" in n]
    cold_direct, cold_rows = measure_all(
        cold, ups[0], cold_load, args.rounds, tmp, lambda: _wait_exact(exact)
    )
    print(
        f"\nchat, {fixture['prompt_tokens']}-token prompts, each with a new system prompt (cached nowhere): "
        f"direct c=1 p50 {cold_direct.p50_us:.0f} us; load average after {os.getloadavg()[0]:.1f}"
    )
    print_table(cold_rows)
    return rows + cold_rows, direct


def _wait_exact(routers: list[tuple[str, int]], timeout: float = 60.0) -> None:
    """Until each lbd router's view of every stub is exact (events followed, tokenizer learned)."""
    import httpx

    for name, port in routers:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = httpx.get(f"http://127.0.0.1:{port}/router/status", timeout=2).json()
                if all(e["kv_events"]["mode"] == "exact" for e in st["endpoints"]) and st["endpoints"]:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        else:
            print(f"  {name}: its view never became exact", file=sys.stderr)


def print_table(rows: list[Row]) -> None:
    print(
        "\n| router | c=1 p50 overhead (us) | c=1 p99 overhead (us) | c=64 req/s | c=64 p50 (us) "
        "| c=64 p99 (us) | CPU ms / 1k req | RSS MiB | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [r.over_p50_us, r.over_p99_us, r.c64_rps, r.c64_p50_us, r.c64_p99_us, r.cpu_ms_per_1k,
                 r.rss_mib]
        print(f"| {r.name} | " + " | ".join(f"{c:.0f}" for c in cells) + f" | {r.errors} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--stub":
        run_stub(int(sys.argv[2]), int(sys.argv[3]), (sys.argv[4:] or [None])[0])
    elif len(sys.argv) > 1 and sys.argv[1] == "--pyload":
        run_pyload(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), (sys.argv[5:] or [""])[0] or None,
                   sys.argv[6:] == ["cold"])
    else:
        sys.exit(main())
