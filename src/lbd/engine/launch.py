"""`lbd serve` / `python -m lbd.engine`: a rank = this process (front end 0) + a core process + optional
extra front ends (``--api-server-count``) sharing the port with SO_REUSEPORT.

Children run in their own process groups with PR_SET_PDEATHSIG: a signal sent to our group (Ctrl-C, a
supervisor's killpg) reaches only this process, which drains the front ends first and stops the core last,
while a SIGKILL of this process still takes every child down with it.
This module stays light (no torch, no prometheus_client at import): PROMETHEUS_MULTIPROC_DIR must be set
before anything imports prometheus_client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lbd.engine.config.args import EngineArgs, engine_args_from_namespace, make_parser, validate
from lbd.engine.config.slices import FrontendConfig, frontend_config
from lbd.engine.procutil import set_pdeathsig, set_process_name, terminate_tree
from lbd.engine.server.responses_store import RESPONSES_DIR_ENV

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from lbd.engine.server.app import Frontend

logger = logging.getLogger("lbd.engine.launch")
_HELLO_TIMEOUT_S = 3600.0  # the core may convert or load a large model first; its death is noticed at once
_CORE_STOP_TIMEOUT_S = 10.0
_RUNTIME_PREFIX = "lbd-engine-"
CORE_PROCESS_NAME = "lbd-core"  # what ps shows for the core (lbd.engine.procutil.set_process_name)


def configure_logging(rank: int, level: str, role: str) -> None:
    mp.current_process().name = role
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), force=True, stream=sys.stderr,
        format=f"%(asctime)s rank={rank} %(processName)s[%(process)d] %(levelname)s %(name)s: %(message)s")


@dataclass(slots=True)
class Runtime:
    """A private temp folder: the core's ipc socket, the Prometheus multiprocess files and the stored
    /v1/responses (shared by the rank's front ends)."""

    path: Path

    @classmethod
    def create(cls) -> Runtime:
        _remove_stale_runtimes()
        path = Path(tempfile.mkdtemp(prefix=f"{_RUNTIME_PREFIX}{os.getpid()}-"))
        (path / "prom").mkdir()
        (path / "responses").mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path / "prom")
        os.environ[RESPONSES_DIR_ENV] = str(path / "responses")  # the rank's stored /v1/responses
        return cls(path)

    @property
    def core_address(self) -> str:
        return f"ipc://{self.path}/core.sock"

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _remove_stale_runtimes() -> None:
    """Folders left by launchers that were SIGKILLed (their pid is gone)."""
    pattern = re.compile(re.escape(_RUNTIME_PREFIX) + r"(\d+)-")
    for entry in Path(tempfile.gettempdir()).glob(f"{_RUNTIME_PREFIX}*"):
        m = pattern.match(entry.name)
        if m and entry.is_dir() and entry.stat().st_uid == os.getuid() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- child process entry points (module level: the spawn context pickles them by name) ----

def _core_entry(args: EngineArgs, model_path: str, address: str, parent_pid: int) -> None:
    set_pdeathsig(signal.SIGKILL, parent_pid)
    os.setpgrp()
    set_process_name(CORE_PROCESS_NAME)
    configure_logging(args.rank, args.log_level, "EngineCore")
    from lbd.engine.rank_core import run

    run(args, model_path, address)
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Skip interpreter teardown (seconds with torch loaded on a busy machine): sockets are closed, metrics
    live in shared mmaps, and logs are flushed here."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _frontend_entry(config: FrontendConfig, model_path: str, address: str, core_pid: int, index: int,
                    conn: Connection, parent_pid: int) -> None:
    set_pdeathsig(signal.SIGKILL, parent_pid)
    os.setpgrp()
    configure_logging(config.rank, config.observability.log_level, f"FrontEnd-{index}")
    import uvloop

    _exit_now(uvloop.run(_frontend_child(config, model_path, address, core_pid, index, conn)))


async def _frontend_child(config: FrontendConfig, model_path: str, address: str, core_pid: int, index: int,
                          conn: Connection) -> int:
    from lbd.engine.server.app import Frontend

    stop = _stop_event()
    fe = Frontend(config, model_path, address, core_pid, index)
    try:
        if not await _until(stop, _connect_and_listen(fe)):
            return 0
        conn.send(("ready", os.getpid()))
        await stop.wait()
        await fe.drain()
        return 0
    except Exception as e:
        logger.error("front end %d failed to start: %s", index, e)
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    finally:
        await fe.close()


async def _connect_and_listen(fe: Frontend) -> None:
    await fe.connect(_HELLO_TIMEOUT_S)
    await fe.listen()


def _stop_event() -> asyncio.Event:
    """Set by SIGTERM/SIGINT; a second signal exits at once (no drain)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting without draining", signal.Signals(sig).name)
            os._exit(1)
        logger.info("%s received: shutting down", signal.Signals(sig).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return stop


async def _until(stop: asyncio.Event, work: Any) -> bool:
    """Run ``work``; False if a stop signal came first (the work is cancelled)."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return False


# ---- the launcher ----

class Launcher:
    """Starts the rank's processes: the core gets the flags (it resolves the device and cuts its own slices),
    every front end gets the front end's slices, cut here once."""

    def __init__(self, args: EngineArgs, runtime: Runtime, model_path: str) -> None:
        self.args = args
        self.frontend = frontend_config(args)
        self.runtime = runtime
        self.model_path = model_path
        self.ctx = mp.get_context("spawn")
        self.core: BaseProcess | None = None
        self.children: list[tuple[BaseProcess, Connection]] = []

    def run(self) -> int:
        import uvloop

        address = self.runtime.core_address
        self.core = self.ctx.Process(target=_core_entry, name="EngineCore",
                                     args=(self.args, self.model_path, address, os.getpid()))
        self.core.start()
        try:
            self._start_children()
            return uvloop.run(self._serve())
        finally:
            logger.debug("stopping front ends")
            self._stop_children()
            logger.debug("stopping the core")
            self._stop_core()
            logger.info("engine stopped")

    def _start_children(self) -> None:
        """Extra front ends start with the core, so they load their tokenizer while it loads the model."""
        assert self.core is not None and self.core.pid is not None
        for index in range(1, self.frontend.server.api_server_count):
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_frontend_entry, name=f"FrontEnd-{index}",
                args=(self.frontend, self.model_path, self.runtime.core_address, self.core.pid, index, send,
                      os.getpid()))
            proc.start()
            send.close()
            self.children.append((proc, recv))

    async def _serve(self) -> int:
        from lbd.engine.server.app import Frontend
        from lbd.engine.server.core_client import CoreError

        assert self.core is not None
        stop = _stop_event()
        fe = Frontend(self.frontend, self.model_path, self.runtime.core_address, self.core.pid, 0)
        try:
            try:
                if not await _until(stop, self._start(fe)):
                    return 0
            except (CoreError, TimeoutError, OSError, RuntimeError) as e:
                logger.error("start-up failed: %s", e)
                return 1
            watcher = asyncio.create_task(self._watch_children())
            server = self.frontend.server
            logger.info("engine ready: model %s, %d front end(s) on port %d", self.frontend.model.model_name,
                        server.api_server_count, server.port)
            await stop.wait()
            watcher.cancel()
            for proc, _ in self.children:
                if proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGTERM)  # they drain in parallel with us
            await fe.drain()
            await self._join_children(server.shutdown_timeout + 5.0)
            return 0
        finally:
            await fe.close()

    async def _start(self, fe: Frontend) -> None:
        await fe.connect(_HELLO_TIMEOUT_S)
        for index, (proc, conn) in enumerate(self.children, start=1):
            await self._child_ready(index, proc, conn)
        await fe.listen()

    async def _child_ready(self, index: int, proc: BaseProcess, conn: Connection) -> None:
        while not conn.poll(0):
            if not proc.is_alive():
                raise RuntimeError(f"front end {index} exited with code {proc.exitcode} during start-up")
            await asyncio.sleep(0.05)
        try:
            status, detail = conn.recv()
        except EOFError as e:
            raise RuntimeError(f"front end {index} exited during start-up") from e
        if status != "ready":
            raise RuntimeError(f"front end {index} failed: {detail}")

    async def _watch_children(self) -> None:
        reported: set[int] = set()
        while True:
            await asyncio.sleep(1.0)
            for index, (proc, _) in enumerate(self.children, start=1):
                if index not in reported and not proc.is_alive():
                    reported.add(index)
                    logger.error("front end %d (pid %s) exited with code %s", index, proc.pid, proc.exitcode)
            if self.core is not None and 0 not in reported and not self.core.is_alive():
                reported.add(0)
                logger.error("engine core (pid %s) exited with code %s: /health now answers 503",
                             self.core.pid, self.core.exitcode)

    async def _join_children(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.is_alive() for p, _ in self.children) and loop.time() < deadline:
            await asyncio.sleep(0.05)

    def _stop_children(self) -> None:
        for proc, conn in self.children:
            if proc.is_alive() and proc.pid is not None:
                terminate_tree(proc.pid, timeout=5.0)
            proc.join(1.0)
            conn.close()

    def _stop_core(self) -> None:
        core = self.core
        if core is None or core.pid is None:
            return
        if core.is_alive():
            terminate_tree(core.pid, timeout=_CORE_STOP_TIMEOUT_S)
        core.join(1.0)
        if core.exitcode not in (0, None, -signal.SIGTERM):
            logger.warning("engine core exited with code %s", core.exitcode)


def check_serve_only(args: EngineArgs) -> str | None:
    """Deployment flags that one engine rank cannot act on (refused here; ``lbd serve`` hands a deployment to
    lbd.serve before it gets here, ``python -m lbd.engine`` is always one rank)."""
    if args.data_parallel_start_rank is not None:
        return ("--data-parallel-start-rank names a node's first rank (lbd supervise, lbd serve "
                "--data-parallel-size N); one engine rank takes --data-parallel-rank instead")
    if args.data_parallel_size > 1 and args.data_parallel_rank is None:
        return (f"--data-parallel-size {args.data_parallel_size} without --data-parallel-rank is a "
                f"deployment of {args.data_parallel_size} ranks: run lbd serve (or lbd supervise) with "
                "it, or pass --data-parallel-rank to start one of its ranks")
    return None


def _check_model_flags(args: EngineArgs, model_path: str) -> int:
    """The flags against the model (TP/PP sizes and support, the KV-cache dtype) and the devices: 2 (after
    one line on stderr) before anything starts, else 0; warnings are logged."""
    from lbd.engine.config.parallel import ModelFacts, ParallelConfigError, check_rank

    try:
        facts = ModelFacts.from_config(Path(model_path) / "config.json")
    except (OSError, KeyError, ValueError) as e:
        logger.warning("cannot read %s/config.json for the parallelism checks: %s", model_path, e)
        facts = None
    try:
        warning = check_rank(args, facts, dict(os.environ))
    except ParallelConfigError as e:
        print(f"lbd serve: error: {e}", file=sys.stderr)
        return 2
    if warning:
        logger.warning("%s", warning)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one engine rank until SIGTERM/SIGINT; the process exits here (no interpreter teardown)."""
    parser = make_parser("lbd serve")
    args = engine_args_from_namespace(parser.parse_args(sys.argv[1:] if argv is None else argv))
    validate(args, parser)
    problem = check_serve_only(args)
    if problem:
        parser.error(problem)
    if args.chat_template:
        from lbd.engine.tokenizer import read_template

        try:
            read_template(args.chat_template)
        except (ValueError, OSError) as e:
            parser.error(str(e))
    runtime = Runtime.create()
    configure_logging(args.rank, args.log_level, "Launcher")
    try:
        from lbd.engine.config.model_files import ModelNotFoundError
        from lbd.engine.loader import resolve_model

        try:
            model_path = str(resolve_model(args.model))
        except ModelNotFoundError as e:
            print(f"lbd serve: error: {e}", file=sys.stderr)
            code = 2
        else:
            code = _check_model_flags(args, model_path) or Launcher(args, runtime, model_path).run()
    finally:
        runtime.remove()
    _exit_now(code)
    return code
