"""One rank's OS processes: spawn its launcher under a reaper tied to our life, relay its log, end its tree.

Each rank runs as ``reaper -> launcher -> the engine's processes``. The reaper (``lbd.supervisor.reaper``) is
a child subreaper with a catchable death signal (SIGTERM) towards us, and the far end of a socket of ours:
when the supervisor dies, however (SIGKILL included), or the launcher exits, it SIGKILLs everything under it,
daemonized grandchildren included (they are re-parented to it, never to init), and exits as the launcher did.
The launcher keeps a death signal (SIGKILL) towards the reaper, and its own session and process group, so
``pid`` (the launcher's, what /status shows) takes signals as before: a graceful SIGTERM goes to it directly.
A death signal follows the parent *thread*: reapers are forked by ``lbd.supervisor.spawn``'s one long-lived
thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO

import psutil

from lbd.common.redact import redact_text
from lbd.supervisor import reaper
from lbd.supervisor.config import RankSpec
from lbd.supervisor.spawn import Child, spawn

if TYPE_CHECKING:
    from lbd.wire.status import WorkerProcess

log = logging.getLogger("lbd.supervisor")

_PR_SET_PDEATHSIG = 1
WORKER_MODULE = "lbd.engine.executor.worker"  # how a rank's TP/PP workers show in their command line
_LINE_LIMIT = 1 << 20  # longest log line read at once; longer ones are relayed in pieces
TAIL_LINES = 20  # last lines of a rank's stderr kept for /status, and as many of its error lines
_TAIL_LINE_CHARS = 500
_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b: ")  # a traceback's last line
_ERROR_LINE = re.compile(r"\b(error|failed|fatal)\b", re.IGNORECASE)
# An engine refusing its command line or configuration: nothing a restart can change. argparse's error line
# ("vllm serve: error: unrecognized arguments: ...", "lbd serve: error: ..."), or an exception raised while
# the engine builds its config from its flags (vLLM: EngineArgs.create_engine_config and vllm/config/*.py,
# e.g. "ValueError: Non-MoE models do not support external data parallel mode", or pydantic's
# ValidationError of a config class).
_USAGE_LINE = re.compile(r"^[\w .\-/]*: error: \S")
_CONFIG_FRAME = re.compile(r'File ".*/vllm/(engine/arg_utils|config/\w+)\.py", line \d+')
_CONFIG_EXCEPTION = re.compile(r"^(ValueError|TypeError|[\w.]*ValidationError)\b")
_PROCESS_PREFIX = re.compile(r"^\(\w+ pid=\d+\) ")  # vLLM's prefix on its processes' output
# An error line, from either stream (vLLM and SGLang log to stdout, their errors included): a line logged at
# level ERROR/CRITICAL or an exception's line, but not a traceback's frames (vLLM logs each one at ERROR)
_ERROR_MARK = re.compile(r"\b(ERROR|CRITICAL|FATAL)\b|^[\w.]*(Error|Exception)\b(: |$)")
_FRAME = re.compile(r"(^|\] )(\s|Traceback |\^)")
REAPER_START_S = 60.0  # longest wait for a reaper to report its launcher's pid (a loaded machine)
_LIBC: ctypes.CDLL | None = None
with contextlib.suppress(OSError):
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child must not dlopen between fork and exec


def child_setup(parent_pid: int, sig: int = signal.SIGKILL) -> Callable[[], None]:
    """preexec_fn of a child that must die with this process (also lbd serve's router and supervisor): it gets
    ``sig`` when we die (a reaper gets SIGTERM, which it catches to clean up)."""

    def setup() -> None:
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent_pid:  # we died before prctl took effect: the signal will never come
            os._exit(1)

    return setup


class RankProcess:
    """A started rank: its reaper (``proc``, whose exit status is the launcher's), its launcher's pid (also
    its process group id) and the relay of its output."""

    def __init__(self, spec: RankSpec, proc: Child, control: socket.socket | None = None) -> None:
        self.spec = spec
        self.proc = proc
        self.reaper_pid: int = proc.pid
        self.pid: int = proc.pid  # the launcher's, once the reaper has told it (start())
        self._control = control  # closing it tells the reaper to end the rank
        # redacted, for /status: its last stderr lines, and its last error lines from either stream
        self.stderr_tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.error_lines: deque[str] = deque(maxlen=TAIL_LINES)
        self._relays = [asyncio.create_task(_relay(proc.stdout, sys.stdout.buffer, spec.rank, None,
                                                   self.error_lines)),
                        asyncio.create_task(_relay(proc.stderr, sys.stderr.buffer, spec.rank,
                                                   self.stderr_tail, self.error_lines))]

    def error_line(self) -> str | None:
        """The line that says why: a traceback's last line (the exception), else the last line that mentions
        an error, else the last line."""
        for pattern in (_EXCEPTION_LINE, _ERROR_LINE):
            for line in reversed(self.stderr_tail):
                if pattern.search(line):
                    return line
        return self.stderr_tail[-1] if self.stderr_tail else None

    def refusal(self) -> str | None:
        """The line saying the engine refused its flags or configuration, once it exited on its own (not
        killed): a usage error that no restart can fix. None otherwise."""
        if self.proc.returncode is None or self.proc.returncode <= 0:
            return None
        lines = [_PROCESS_PREFIX.sub("", line) for line in self.stderr_tail]
        usage = next((line for line in reversed(lines) if _USAGE_LINE.search(line)), None)
        if usage is not None:
            return usage
        last = next((i for i in range(len(lines) - 1, -1, -1) if _EXCEPTION_LINE.search(lines[i])), None)
        if last is None or not _CONFIG_EXCEPTION.search(lines[last]):
            return None
        start = max((i for i in range(last) if lines[i].startswith("Traceback")), default=0)
        return lines[last] if any(_CONFIG_FRAME.search(line) for line in lines[start:last]) else None

    @classmethod
    async def start(cls, spec: RankSpec) -> RankProcess:
        env = {**os.environ, **spec.env}
        env.pop("LBD_ADMIN_TOKEN", None)  # ranks have no use for the supervisor's secret
        ours, theirs = socket.socketpair()
        try:
            proc = await spawn(reaper.argv(theirs.fileno(), spec.argv), env=env, limit=_LINE_LIMIT,
                               preexec_fn=child_setup(os.getpid(), signal.SIGTERM),
                               pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        rank = cls(spec, proc, ours)
        try:
            rank.pid = await rank._launcher_pid()
        except BaseException:
            await rank.kill_tree()
            raise
        return rank

    async def _launcher_pid(self) -> int:
        """The pid the reaper reports once it started the launcher; OSError where it could not."""
        assert self._control is not None
        self._control.setblocking(False)
        loop = asyncio.get_running_loop()
        data = b""
        try:
            async with asyncio.timeout(REAPER_START_S):
                while not data.endswith(b"\n") and not data.startswith(reaper.ERROR_PREFIX):
                    chunk = await loop.sock_recv(self._control, 4096)
                    if not chunk:
                        break
                    data += chunk
                if data.startswith(reaper.ERROR_PREFIX):  # the whole message, up to the reaper's exit
                    while chunk := await loop.sock_recv(self._control, 4096):
                        data += chunk
        except TimeoutError:
            raise OSError(f"the rank's reaper reported no launcher within {REAPER_START_S:g} s") from None
        if data.startswith(reaper.ERROR_PREFIX):
            raise OSError(data[len(reaper.ERROR_PREFIX):].decode(errors="replace"))
        if not data.endswith(b"\n"):
            code = await self.wait()
            raise OSError(f"the rank's reaper exited ({code}) before starting it: {self.error_line()}")
        return int(data)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        """The exit code, once the relays had a moment to take the last lines in (the tail is then whole)."""
        code = await self.proc.wait()
        await asyncio.wait(self._relays, timeout=1.0)
        return code

    def terminate(self) -> None:
        """SIGTERM the launcher only (it drains its front ends, then stops its core); SIGCONT the whole
        tree in case it was stopped, so the signal can be acted on."""
        if self.proc.returncode is None and self.pid != self.reaper_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            for p in _descendants(self.reaper_pid)[1:]:
                with contextlib.suppress(psutil.Error):
                    p.resume()

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM, wait up to ``grace_s`` for the launcher to exit, then SIGKILL the whole tree."""
        self.terminate()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), grace_s)
        await self.kill_tree()
        return self.proc.returncode

    async def kill_tree(self) -> None:
        """End the rank now: the reaper SIGKILLs everything under it (told by closing its socket), and so do
        we, with the launcher's process group; wait until they are gone, the reaper too."""
        procs = _descendants(self.reaper_pid) if self.proc.returncode is None else []
        self._close_control()
        for p in procs[1:]:  # not the reaper: it still has orphans to collect
            with contextlib.suppress(psutil.Error):
                p.kill()
        if self.pid != self.reaper_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the group outlives a dead launcher while members live
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), 5.0)
        if self.proc.returncode is None:  # a reaper that cannot finish: its children are SIGKILLed already
            log.warning("rank %d: reaper %d still running 5 s after the rank was killed", self.spec.rank,
                        self.reaper_pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.reaper_pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), 5.0)
        await _wait_gone(procs, 5.0)
        await self.close_relays()

    def _close_control(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def workers(self) -> list[WorkerProcess]:
        """The rank's TP/PP worker processes, found in its tree by their command line
        (``-m lbd.engine.executor.worker --rank R --tp-rank T --pp-rank P --cpus C``)."""
        from lbd.wire.status import WorkerProcess  # lazily, for cold start (lbd.wire.states)

        found = []
        for p in _descendants(self.reaper_pid)[1:]:
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                if WORKER_MODULE in cmd:
                    found.append(WorkerProcess(pid=p.pid, rank=int(_flag(cmd, "--rank") or -1),
                                               tp_rank=int(_flag(cmd, "--tp-rank") or -1),
                                               pp_rank=int(_flag(cmd, "--pp-rank") or -1),
                                               cpus=_flag(cmd, "--cpus")))
        return sorted(found, key=lambda w: w.rank)

    async def close_relays(self) -> None:
        """Let the relays drain what is left in the pipes (they end at EOF), but never hang on them."""
        _, pending = await asyncio.wait(self._relays, timeout=1.0)
        for task in pending:
            task.cancel()
        self._close_control()
        self.proc.close()


def _flag(cmd: list[str], flag: str) -> str | None:
    i = cmd.index(flag) if flag in cmd else -1
    return cmd[i + 1] if 0 <= i < len(cmd) - 1 else None


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


async def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while procs and loop.time() < deadline:
        procs = [p for p in procs if _alive(p)]
        if procs:
            await asyncio.sleep(0.02)
    for p in procs:
        log.warning("process %d still alive after SIGKILL", p.pid)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


async def _relay(stream: asyncio.StreamReader | None, out: BinaryIO, rank: int,
                 tail: deque[str] | None = None, errors: deque[str] | None = None) -> None:
    """Copy the child's output line by line, each line prefixed with its rank; keep the last lines (secrets
    masked) in ``tail``, and the last error lines in ``errors``."""
    if stream is None:
        return
    prefix = f"[rank {rank}] ".encode()
    while True:
        try:
            line = await stream.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            line = e.partial  # EOF: the last line had no newline
        except asyncio.LimitOverrunError as e:
            line = await stream.readexactly(e.consumed) + b"\n"
        if not line:
            return
        if line.strip() and (tail is not None or errors is not None):
            text = line.decode("utf-8", "replace").rstrip()[:_TAIL_LINE_CHARS]
            if tail is not None:
                tail.append(redact_text(text))
            if errors is not None and _ERROR_MARK.search(text) and not _FRAME.search(text):
                errors.append(redact_text(text))
        try:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
        except (OSError, ValueError):
            pass  # our own stdout is gone (closed pipe): keep draining so the child never blocks
