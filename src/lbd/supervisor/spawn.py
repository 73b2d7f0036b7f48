"""Start a child without stalling the event loop: fork and exec in one long-lived thread.

A child that must die with us sets PR_SET_PDEATHSIG in a preexec_fn, which makes ``subprocess`` fork (not
vfork) and then wait in the calling thread until the child has exec'd: milliseconds on a busy machine, more
on a loaded one, and an event loop that spawns that way answers nothing meanwhile (a supervisor restarting
ranks while its health port is polled). Here the fork and that wait run in a thread of their own; the loop
only gets the result. The death signal follows the *thread* that forked (prctl(2)), so this thread is never
ended before the process is: one thread for the life of the process, not a pool thread that may be retired.
Exit is read from a pidfd where the kernel has them (Linux 5.3+), else polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

_POLL_S = 0.05  # exit polling, where there are no pidfds


class _SpawnThread:
    """The one thread that forks our children; a daemon, so it ends only with the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="lbd-spawn", daemon=True).start()

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._jobs.put((job, fut))
        return fut

    def _run(self) -> None:
        while True:
            job, fut = self._jobs.get()
            try:
                fut.set_result(job())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                fut.set_exception(e)


_THREAD: _SpawnThread | None = None
_THREAD_LOCK = threading.Lock()


def _spawn_thread() -> _SpawnThread:
    global _THREAD
    with _THREAD_LOCK:
        if _THREAD is None:
            _THREAD = _SpawnThread()
        return _THREAD


class Child:
    """A started child as a coroutine sees it: ``pid``, ``returncode``, ``wait()``, and, where piped, its
    ``stdout`` and ``stderr`` as StreamReaders (the shape of ``asyncio.subprocess.Process``)."""

    def __init__(self, popen: subprocess.Popen[bytes], limit: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._limit = limit
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._transports: list[asyncio.BaseTransport] = []
        self._pidfd = -1

    async def _attach(self) -> None:
        for name in ("stdout", "stderr"):
            pipe = getattr(self._popen, name)
            if pipe is not None:
                reader = asyncio.StreamReader(limit=self._limit, loop=self._loop)
                transport, _ = await self._loop.connect_read_pipe(
                    lambda r=reader: asyncio.StreamReaderProtocol(r), pipe)
                self._transports.append(transport)
                setattr(self, name, reader)
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # an old kernel (or not Linux): poll
            self._loop.create_task(self._poll_exit())
            return
        self._loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        if self._popen.poll() is None:  # readable means exited; reaped by someone else, poll says so too
            return
        self._close_pidfd()
        self._settle()

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1

    def close(self) -> None:
        """Close the output pipes (whatever is left unread is dropped) and stop watching for the exit. The
        pipes' write ends may outlive the child in processes it started: EOF alone would not free them."""
        for transport in self._transports:
            transport.close()
        self._transports.clear()
        if self.returncode is not None:
            self._close_pidfd()

    async def _poll_exit(self) -> None:
        while self._popen.poll() is None:
            await asyncio.sleep(_POLL_S)
        self._settle()

    def _settle(self) -> None:
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


def _kill_started(job: Future[subprocess.Popen[bytes]]) -> None:
    if job.exception() is None:
        popen = job.result()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


async def spawn(argv: Sequence[str], *, env: Mapping[str, str], preexec_fn: Callable[[], None],
                pipe_output: bool = True, limit: int = 1 << 16, pass_fds: Sequence[int] = ()) -> Child:
    """Start ``argv`` in a session of its own, stdin from /dev/null, output piped (or inherited); of our
    descriptors it inherits only ``pass_fds``."""
    out = subprocess.PIPE if pipe_output else None

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, preexec_fn=preexec_fn, pass_fds=tuple(pass_fds))

    job = _spawn_thread().submit(start)
    try:
        popen = await asyncio.shield(asyncio.wrap_future(job))
    except asyncio.CancelledError:  # the child starts anyway: it must not outlive the caller's interest
        job.add_done_callback(_kill_started)
        raise
    child = Child(popen, limit)
    await child._attach()
    return child
