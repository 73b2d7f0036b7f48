"""The soak's chaos and its bookkeeping: faults injected into a running `lbd supervise` + `lbd route`, and the
per-process resource sampler (RSS, open FDs, threads) of every process of the deployment."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx
import psutil

ACTIONS = ("stop_core", "cut_upstream_links", "kill_rank", "rolling_restart", "kill_core", "stop_rank")
CORE, TOKENIZE = "lbd-core", "lbd-tokenize"


@dataclass
class Chaos:
    """Cycles through ACTIONS, alternating the target rank; only acts while every rank is ready (taking down
    the last ready rank would lose requests by construction, whatever the software did)."""

    node: object  # support.node.SupervisorNode
    router: object  # support.RouterServer
    admin_token: str
    ranks: int
    done: list[dict] = field(default_factory=list)
    _turn: int = 0

    def ready(self) -> bool:
        try:
            status = self.node.status()
            routed = self.router.status()["endpoints"]
        except (httpx.HTTPError, ValueError):
            return False
        rolling = status.get("rolling_restart") or {}
        return (status["ready_ranks"] == self.ranks and rolling.get("state") != "running"
                and len(routed) == self.ranks and all(e["state"] == "ready" for e in routed))

    def act(self, t: float) -> dict:
        action = ACTIONS[self._turn % len(ACTIONS)]
        rank = (self._turn // len(ACTIONS) + self._turn) % self.ranks
        self._turn += 1
        record = {"t": round(t, 2), "action": action, "rank": rank, "detail": ""}
        try:
            record["detail"] = getattr(self, action)(rank)
        except Exception as e:  # noqa: BLE001 - a failed action is reported, the soak goes on
            record["detail"] = f"failed: {type(e).__name__}: {e}"
        self.done.append(record)
        return record

    def _tree(self, rank: int) -> list[psutil.Process]:
        return self.node.rank_tree(rank)

    def _named(self, rank: int, name: str) -> psutil.Process:
        return next(p for p in self._tree(rank) if p.name() == name)

    def kill_rank(self, rank: int) -> str:
        pid = self.node.rank(rank)["pid"]
        os.kill(pid, signal.SIGKILL)
        return f"SIGKILL launcher {pid}"

    def kill_core(self, rank: int) -> str:
        core = self._named(rank, CORE)
        core.kill()
        return f"SIGKILL core {core.pid}"

    def stop_core(self, rank: int) -> str:
        core = self._named(rank, CORE)
        core.suspend()  # the supervisor restarts the rank (SIGCONT first, so it can drain)
        return f"SIGSTOP core {core.pid}"

    def stop_rank(self, rank: int) -> str:
        pid = self.node.rank(rank)["pid"]
        os.kill(pid, signal.SIGSTOP)
        return f"SIGSTOP launcher {pid}"

    def rolling_restart(self, rank: int) -> str:
        r = self.node.post("/rolling-restart", token=self.admin_token)
        return f"POST /rolling-restart -> {r.status_code}"

    def cut_upstream_links(self, rank: int) -> str:
        """Reset every TCP connection of the router to the ranks (as a network blip would), with `ss -K`."""
        ports = {self.node.base_port + i for i in range(self.ranks)}
        cut = 0
        for proc in [psutil.Process(self.router.proc.pid), *psutil.Process(self.router.proc.pid).children()]:
            for c in proc.net_connections("tcp"):
                if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED:
                    subprocess.run(["ss", "-K", "src", f"{c.laddr.ip}", "sport", "=", f":{c.laddr.port}",
                                    "dst", f"{c.raddr.ip}", "dport", "=", f":{c.raddr.port}"],
                                   capture_output=True, timeout=10)
                    cut += 1
        return f"reset {cut} router->rank connections"


@dataclass
class Sampler:
    """RSS, open FDs and threads of every process of the deployment, by role, over time."""

    node: object
    router: object
    ranks: int
    rows: list[dict] = field(default_factory=list)

    def roles(self) -> dict[str, psutil.Process]:
        out: dict[str, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            out["router"] = psutil.Process(self.router.proc.pid)
        with contextlib.suppress(psutil.Error):
            out["supervisor"] = psutil.Process(self.node.proc.pid)
        for r in range(self.ranks):
            with contextlib.suppress(Exception):
                pid = self.node.rank(r)["pid"]
                if pid:
                    launcher = psutil.Process(pid)
                    out[f"rank{r}.front_end"] = launcher
                    for child in launcher.children(recursive=True):
                        name = child.name()
                        if name == CORE:
                            out[f"rank{r}.core"] = child
                        elif name == TOKENIZE:
                            out[f"rank{r}.tokenizer"] = child
        return out

    def sample(self, t: float) -> None:
        for role, proc in self.roles().items():
            try:
                with proc.oneshot():
                    self.rows.append({"t": round(t, 2), "role": role, "pid": proc.pid,
                                      "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                                      "fds": proc.num_fds(), "threads": proc.num_threads()})
            except psutil.Error:
                pass


def flatness(rows: list[dict], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per role, after warm-up: first, last and max of RSS, FDs and threads (one process incarnation per
    role at a time; a restarted rank starts a new one, so ranks are judged on their last incarnation)."""
    out: dict[str, dict[str, float]] = {}
    for role in sorted({r["role"] for r in rows}):
        mine = [r for r in rows if r["role"] == role and r["t"] >= warmup_s]
        if not mine:
            continue
        last_pid = mine[-1]["pid"]
        life = [r for r in mine if r["pid"] == last_pid]
        out[role] = {f"{k}_{w}": v for k in ("rss_mb", "fds", "threads")
                     for w, v in (("first", life[0][k]), ("last", life[-1][k]),
                                  ("max", max(x[k] for x in mine)))}
        out[role]["incarnations"] = len({r["pid"] for r in mine})
        out[role]["span_s"] = round(life[-1]["t"] - life[0]["t"], 1)
    return out


def wait_for(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if pred():
                return True
        time.sleep(0.2)
    return False
