"""A rank's reaper: the small process between the supervisor and a rank's launcher, so that nothing of the
rank outlives either of them, whatever the engine starts.

    python -m lbd.supervisor.reaper FD ARGV...

It marks itself a child subreaper (``PR_SET_CHILD_SUBREAPER``): every process the launcher starts, and every
daemon those start (double fork, ``setsid``, a process group of its own), is re-parented to it when its
parent dies, never to init. It starts ARGV (the launcher) in a session of its own, with a death signal
(SIGKILL) towards itself, writes the launcher's pid on FD (one end of a socket pair whose other end only the
supervisor holds), and waits for the first of:

- the launcher exits (on its own, or by a signal someone sent it: the supervisor's graceful SIGTERM goes to
  the launcher directly);
- FD reads EOF: the supervisor is gone (however it died), or closed its end to end the rank now;
- SIGTERM, SIGHUP or SIGINT: the supervisor spawns it with a *catchable* death signal (SIGTERM).

Then it SIGKILLs every descendant until none is left (orphans keep coming back to it, being a subreaper),
and exits as the launcher did: the same exit code, or killed by the same signal, so the supervisor reads the
rank's exit status from it. It imports only the standard library and psutil, to start in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
KILL_GIVE_UP_S = 60.0  # a process stuck in uninterruptible sleep this long is left to the kernel
ERROR_PREFIX = b"error: "  # the reaper could not start the launcher: the rest of the message says why


def argv(control_fd: int, launcher: list[str]) -> list[str]:
    """The command line that runs ``launcher`` under a reaper reporting on ``control_fd``."""
    return [sys.executable, "-m", "lbd.supervisor.reaper", str(control_fd), *launcher]


def _prctl(libc: ctypes.CDLL | None, option: int, arg: int) -> bool:
    prctl = getattr(libc, "prctl", None)  # Linux only
    return prctl is not None and prctl(option, arg, 0, 0, 0) == 0


class Reaper:
    """One launcher and everything under it; ``run()`` returns the launcher's wait status."""

    def __init__(self, control: socket.socket, launcher: list[str]) -> None:
        self.control = control
        self.launcher = launcher
        self.stopping = False
        self.launcher_pid = -1
        self.status: int | None = None  # the launcher's wait status, once reaped
        self._popen: subprocess.Popen[bytes] | None = None
        self._wake_r, self._wake_w = os.pipe()
        try:
            self._libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
        except OSError:
            self._libc = None

    def _on_stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def install(self) -> None:
        """Become a subreaper and catch the stop signals (each wakes the loop through the wakeup fd)."""
        if not _prctl(self._libc, _PR_SET_CHILD_SUBREAPER, 1):
            print("lbd reaper: PR_SET_CHILD_SUBREAPER failed: daemonized processes of this rank may outlive "
                  "it", file=sys.stderr, flush=True)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select through the wakeup fd

    def start(self) -> bool:
        """Start the launcher and tell the supervisor its pid (or why it could not start)."""
        me = os.getpid()
        libc = self._libc

        def setup() -> None:  # in the launcher, before exec: die with the reaper
            _prctl(libc, _PR_SET_PDEATHSIG, int(signal.SIGKILL))
            if os.getppid() != me:
                os._exit(1)

        try:
            proc = subprocess.Popen(self.launcher, start_new_session=True, preexec_fn=setup)
        except (OSError, subprocess.SubprocessError) as e:
            with contextlib.suppress(OSError):
                self.control.sendall(ERROR_PREFIX + str(e).encode(errors="replace"))
            return False
        self._popen = proc  # kept, never waited on through Popen: _reap() collects every child's status
        self.launcher_pid = proc.pid
        with contextlib.suppress(OSError):
            self.control.sendall(f"{proc.pid}\n".encode())
        return True

    def _reap(self) -> bool:
        """Reap every exited child (the launcher's status is kept); False once there are no children."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.launcher_pid:
                self.status = status

    def wait(self) -> None:
        """Block until the launcher exits, the supervisor is gone, or a stop signal came."""
        self.control.setblocking(False)
        while not self.stopping and self.status is None:
            try:
                ready, _, _ = select.select([self.control, self._wake_r], [], [])
            except InterruptedError:
                continue
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 512)
            self._reap()
            if self.control in ready:
                try:
                    if not self.control.recv(512):
                        return  # EOF: the supervisor is gone, or ends the rank
                except BlockingIOError:
                    pass
                except OSError:
                    return

    def kill_all(self) -> None:
        """SIGKILL every descendant, again and again, until this process has no child left."""
        me = psutil.Process()
        deadline = time.monotonic() + KILL_GIVE_UP_S
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                for p in me.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        p.kill()
            if not self._reap():
                return
            time.sleep(0.01)

    def run(self) -> int | None:
        self.install()
        if not self.stopping and self.start():
            self.wait()
        self.kill_all()
        return self.status


def exit_as(status: int | None) -> None:
    """Exit with the launcher's exit code, or be killed by the signal that killed it."""
    if status is None:
        os._exit(1)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a core dump of the reaper helps nobody
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught: nothing to undo
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    if len(sys.argv) < 3:
        print("usage: python -m lbd.supervisor.reaper FD ARGV...", file=sys.stderr)
        os._exit(2)
    control = socket.socket(fileno=int(sys.argv[1]))
    exit_as(Reaper(control, sys.argv[2:]).run())


if __name__ == "__main__":
    main()
