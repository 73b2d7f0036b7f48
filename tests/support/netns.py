"""Network namespaces as test "nodes": each its own loopback and addresses, joined by veth pairs (iproute2).

Needs root and a kernel that lets us create namespaces; `unavailable()` says why not (tests skip with it).
Processes run in a namespace through `ip netns exec`; the test's own HTTP calls run in a thread that joined
the namespace (`call`: a network namespace is per thread), so no traffic ever leaves the namespaces the test
made. `close()` kills every process still in them and deletes them (and with them the veth links).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from support import spawn

T = TypeVar("T")
_CLONE_NEWNET = 0x40000000


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"lbdprobe{uuid.uuid4().hex[:6]}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Namespaces:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.names: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def add(self, label: str) -> str:
        name = f"lbd{label}{self.tag}"
        _ip("netns", "add", name)
        self.names.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def link(self, a: str, addr_a: str, b: str, addr_b: str, prefix: int = 24) -> tuple[str, str]:
        """A veth pair between namespaces ``a`` and ``b`` with these addresses; the two device names."""
        dev_a, dev_b = f"va{self.tag}{len(self.names)}", f"vb{self.tag}{len(self.names)}"
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        _ip("link", "set", dev_a, "netns", a)
        _ip("link", "set", dev_b, "netns", b)
        for ns, dev, addr in ((a, dev_a, addr_a), (b, dev_b, addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/{prefix}", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        return dev_a, dev_b

    def hosts(self, ns: str, lines: list[str]) -> None:
        """/etc/hosts as processes started in ``ns`` see it (`ip netns exec` mounts /etc/netns/<ns>/hosts);
        rewritten in place, so running processes see each change too."""
        path = Path("/etc/netns") / ns / "hosts"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+" if path.exists() else "w") as f:
            f.seek(0)
            f.write("".join(line + "\n" for line in lines))
            f.truncate()

    def set_link(self, ns: str, dev: str, up: bool) -> None:
        _ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def spawn(self, ns: str, argv: list[str], log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        proc = spawn(["ip", "netns", "exec", ns, *argv], env=env, log=log)
        self.procs.append(proc)
        return proc

    def call(self, ns: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run ``fn`` in a thread whose sockets live in namespace ``ns``."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                with open(f"/var/run/netns/{ns}") as f:
                    libc = ctypes.CDLL(None, use_errno=True)
                    if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns({ns}) failed")
                box["value"] = fn(*args, **kw)
            except BaseException as e:  # re-raised in the caller
                box["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def pids(self, ns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for ns in self.names:
            for pid in self.pids(ns):  # anything else we started in there (reparented children)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        self.names.clear()
