"""`lbd route`: parse flags, then run one worker in-process or fork N workers sharing the port.

With ``--workers N`` the parent creates the shared dispatch counters, forks the workers (each binds the port
with SO_REUSEPORT), forwards SIGTERM/SIGINT/SIGHUP to them, and replaces a worker that dies (closing out the
dead worker's counters first, since its requests died with its connections).
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from lbd.router.config import RouterConfig, parse_args

log = logging.getLogger("lbd.router")


def _setup_logging(level: str, worker: int) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        force=True,
        format=f"%(asctime)s route[w{worker} pid %(process)d] %(levelname)s %(message)s",
    )


def _port_free(cfg: RouterConfig) -> str | None:
    """Bind once (without SO_REUSEPORT) to turn 'address in use' into a flag error before forking."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((cfg.host, cfg.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"--port {cfg.port}: address {cfg.host}:{cfg.port} is already in use"
            return f"--host {cfg.host}: cannot bind: {e.strerror}"
    return None


def _run_worker(cfg: RouterConfig, shared, worker: int) -> None:
    import asyncio

    import uvloop

    from lbd.router.app import serve

    shared.bind_worker(worker)
    _setup_logging(cfg.log_level, worker)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        uvloop.run(serve(cfg, shared))
    except KeyboardInterrupt:
        pass
    del asyncio


def _worker_main(cfg: RouterConfig, shared, worker: int) -> None:
    """A forked worker: dies with the parent even if the parent is SIGKILLed (Linux PR_SET_PDEATHSIG). The
    parent's forwarding handlers are not its own: a signal before its loop installs its handlers (while it
    starts) takes the default action."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before the prctl took effect
            return
    _run_worker(cfg, shared, worker)


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    problem = _port_free(cfg)
    if problem:
        sys.stderr.write(f"lbd route: error: {problem}\n")
        return 2
    if cfg.workers == 1:
        from lbd.router.shared import SharedCounters

        _run_worker(cfg, SharedCounters(1), 0)
        return 0
    # Counters and histograms of every worker are summed at exposition (prometheus multiprocess mode); the
    # variable must be set before prometheus_client is first imported.
    mp_dir = tempfile.mkdtemp(prefix="lbd-route-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir
    try:
        return _supervise_workers(cfg)
    finally:
        shutil.rmtree(mp_dir, ignore_errors=True)


def _supervise_workers(cfg: RouterConfig) -> int:
    from lbd.router.shared import SharedCounters

    _setup_logging(cfg.log_level, -1)
    shared = SharedCounters(cfg.workers)
    if cfg.kv_events != "off":  # workers tell each other the prefixes they sent out (before any fork)
        from lbd.router.kv.shared_pending import SharedPending

        shared.kv_pending = SharedPending()
    ctx = multiprocessing.get_context("fork")
    procs: dict[int, multiprocessing.Process] = {}
    stopping = False

    def start(i: int) -> None:
        p = ctx.Process(target=_worker_main, args=(cfg, shared, i), name=f"route-w{i}", daemon=False)
        p.start()
        procs[i] = p

    launcher = os.getpid()

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        if os.getpid() != launcher:  # a worker just forked, before _worker_main reset its handlers
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            return
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for p in procs.values():
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for i in range(cfg.workers):
        start(i)
    while procs:
        time.sleep(0.2)
        for i, p in list(procs.items()):
            if p.is_alive():
                continue
            p.join()
            del procs[i]
            shared.close_out(i)
            _mark_dead(p.pid)
            if not stopping:
                log.error("worker %d (pid %s) exited with %s; starting a new one", i, p.pid, p.exitcode)
                start(i)
    return 0


def _mark_dead(pid: int | None) -> None:
    if pid is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid)
