"""``lbd serve --autoscale MIN:MAX``: the built-in planner for a deployment without Kubernetes (issue 46).

Every ``--autoscale-interval-s`` it reads its own router child's signals (``GET /router/status``'s
``autoscale``: ``lbd.common.scaling.AutoscaleReport``, the same numbers as ``lbd_router_autoscale_*``) and the
node's size (its supervisor's /status), and feeds them to ``lbd.common.scaling.Planner``: the one rule the
router's ``recommended_ranks`` gauge and the Kubernetes manifests use, with hysteresis (up at once after
``--autoscale-up-after-s`` above, down once the mean demand of the last ``--autoscale-down-after-s``
recommends fewer ranks, nothing for ``--autoscale-cooldown-s`` after a change). A decision is a
``POST /scale`` (``lbd.wire.scale.ScaleRequest``) to the node's supervisor: added ranks join the router
through the health port's /status, removed ranks drain and the router resumes their streams elsewhere.
Nothing is decided while a resize runs.

Every decision is logged with the signals behind it; ``deployment.autoscale`` in the health port's /status
is the planner's state (``lbd.wire.status.AutoscaleState``).

One machine only (every rank under this node's supervisor): across nodes each node would resize against the
whole fleet's signals, and Ray-placed ranks cannot be resized yet (``lbd.supervisor.scale``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec

from lbd.common.limits import read_aiohttp
from lbd.common.scaling import TARGET_UTILIZATION, AutoscaleReport, Planner, Signals
from lbd.supervisor.flags import SupervisorArgError
from lbd.wire import scale as wire_scale
from lbd.wire.status import AutoscaleState, SupervisorStatus

log = logging.getLogger("lbd.serve")


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    """``--autoscale MIN:MAX`` and its delays (see ``add_autoscale_arguments``)."""

    min_ranks: int
    max_ranks: int
    interval_s: float = 5.0
    up_after_s: float = 10.0
    down_after_s: float = 120.0
    cooldown_s: float = 30.0
    target_utilization: float = TARGET_UTILIZATION


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    d = AutoscaleSettings(1, 1)
    g = parser.add_argument_group("built-in autoscaling (lbd serve --autoscale MIN:MAX, one machine)")
    g.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="resize this node between MIN and MAX ranks by the router's recommendation "
                        "(lbd_router_autoscale_recommended_ranks): up once it stays above the size for "
                        "--autoscale-up-after-s, down once the mean demand of the last "
                        "--autoscale-down-after-s recommends fewer ranks (to that many); "
                        "--data-parallel-size is the starting size")
    g.add_argument("--autoscale-interval-s", type=float, default=d.interval_s,
                   help="how often the planner reads the router's signals")
    g.add_argument("--autoscale-up-after-s", type=float, default=d.up_after_s,
                   help="add ranks once the recommendation has stayed above the size this long")
    g.add_argument("--autoscale-down-after-s", type=float, default=d.down_after_s,
                   help="remove ranks once the mean demand of this long (since the last resize) recommends "
                        "fewer")
    g.add_argument("--autoscale-cooldown-s", type=float, default=d.cooldown_s,
                   help="decide nothing this long after a resize (its signals settle first)")
    g.add_argument("--autoscale-target-utilization", type=float, default=None,
                   help=f"the router's --autoscale-target-utilization (default {TARGET_UTILIZATION}), in "
                        "(0, 1]: the busy fraction the recommendation aims for, a margin below flow "
                        "control's saturation point (1.0) for the signal's noise and the time added ranks "
                        "take; lower keeps more spare ranks")
    g.add_argument("--ttft-target-ms", type=float, default=None,
                   help="the router's --ttft-target-ms (default 2000): the TTFT its recommendation sizes the "
                        "fleet for (lbd_router_autoscale_*, and --autoscale)")


def autoscale_settings(ns: argparse.Namespace) -> AutoscaleSettings | None:
    """The checked settings (None without --autoscale); SupervisorArgError naming the flag (exit 2)."""
    target = ns.autoscale_target_utilization
    target = TARGET_UTILIZATION if target is None else target
    if not 0 < target <= 1:
        raise SupervisorArgError(f"--autoscale-target-utilization must be in (0, 1], got {target}")
    if ns.autoscale is None:
        for flag in ("interval_s", "up_after_s", "down_after_s", "cooldown_s"):
            if getattr(ns, f"autoscale_{flag}") != getattr(AutoscaleSettings(1, 1), flag):
                raise SupervisorArgError(f"--autoscale-{flag.replace('_', '-')} tunes --autoscale, which is "
                                         "not given: add --autoscale MIN:MAX or drop it")
        return None
    low, sep, high = ns.autoscale.partition(":")
    try:
        lo, hi = int(low), int(high)
    except ValueError:
        lo = hi = -1
    if not sep or lo < 1 or hi < lo:
        raise SupervisorArgError(f"--autoscale takes MIN:MAX ranks with 1 <= MIN <= MAX, e.g. 1:4; got "
                                 f"{ns.autoscale!r}")
    if not ns.autoscale_interval_s > 0:
        raise SupervisorArgError(f"--autoscale-interval-s must be > 0, got {ns.autoscale_interval_s}")
    for flag in ("up_after_s", "down_after_s", "cooldown_s"):
        if getattr(ns, f"autoscale_{flag}") < 0:
            raise SupervisorArgError(f"--autoscale-{flag.replace('_', '-')} must be >= 0, got "
                                     f"{getattr(ns, f'autoscale_{flag}')}")
    return AutoscaleSettings(lo, hi, ns.autoscale_interval_s, ns.autoscale_up_after_s,
                             ns.autoscale_down_after_s, ns.autoscale_cooldown_s, target)


def check_autoscale_topology(ns: argparse.Namespace, local: int, n: int, headless: bool) -> None:
    """--autoscale resizes one machine's ranks behind its own router (module docstring)."""
    why = ("--data-parallel-backend ray (Ray-placed ranks cannot be resized yet)"
           if ns.data_parallel_backend == "ray" else
           "--headless (it runs no router to read)" if headless else
           "ranks on several nodes (each would resize against the whole fleet)" if local != n else None)
    if why is not None:
        raise SupervisorArgError(f"--autoscale resizes one machine's ranks behind its own router; not with "
                                 f"{why}: drop --autoscale")


def autoscale_plan(ns: argparse.Namespace, local: int, n: int, headless: bool,
                   needed: int) -> tuple[AutoscaleSettings | None, int]:
    """The settings and the ready ranks the node needs: with --autoscale, MIN at most (it is ready at every
    size it may take); SupervisorArgError naming the flag."""
    if ns.ttft_target_ms is not None and headless:
        raise SupervisorArgError("--ttft-target-ms is the router's and a --headless node runs none: drop it "
                                 "(give it to the head)")
    settings = autoscale_settings(ns)
    if settings is None:
        return None, needed
    check_autoscale_topology(ns, local, n, headless)
    return settings, min(needed, settings.min_ranks)


class Autoscaler:
    """The planner's loop: signals from ``router_url``, the size from ``status()``, resizes at
    ``supervisor_url``/scale."""

    def __init__(self, settings: AutoscaleSettings, router_url: str, supervisor_url: str,
                 status: Callable[[], SupervisorStatus | None], router_key: str | None,
                 scale_token: str | None, tls: ssl.SSLContext | None) -> None:
        self.s = settings
        self.router_url, self.supervisor_url = router_url, supervisor_url
        self.status = status  # () -> the node supervisor's last SupervisorStatus, or None
        self.router_key, self.scale_token, self.tls = router_key, scale_token, tls
        self.planner = Planner(settings.min_ranks, settings.max_ranks, settings.up_after_s,
                               settings.down_after_s, settings.cooldown_s, settings.target_utilization)
        self.last_decision: str | None = None
        self.error: str | None = None
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0),
                                                  connector=aiohttp.TCPConnector(ssl=self.tls or True))
        return self._session

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.s.interval_s)
                try:
                    await self.step(asyncio.get_running_loop().time())
                    self.error = None
                except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
                    self.error = f"{type(e).__name__}: {e}"
        finally:
            if self._session is not None:
                await self._session.close()

    async def step(self, now: float) -> None:
        node: SupervisorStatus | None = self.status()
        if node is None or (node.scaling is not None and node.scaling.state == wire_scale.RUNNING):
            return  # not polled yet, or a resize runs: its signals are not the new size's yet
        current = node.data_parallel_size_local
        report = await self._signals()
        target = self.planner.observe(report.signals, current, now)
        if target is None or target == current:
            return
        why = _why(report, self.s.target_utilization)
        self.last_decision = f"{current} -> {target} ranks at {time.strftime('%H:%M:%S')}: {why}"
        log.info("autoscale: %s", self.last_decision)
        await self._scale(target)

    async def _signals(self) -> AutoscaleReport:
        headers = {"Authorization": f"Bearer {self.router_key}"} if self.router_key else {}
        async with self.session().get(self.router_url + "/router/status", headers=headers) as resp:
            body = await read_aiohttp(resp)
            if resp.status != 200:
                raise ValueError(f"the router's /router/status answered {resp.status}")
        try:
            return msgspec.convert(msgspec.json.decode(body)["autoscale"], AutoscaleReport)
        except (msgspec.DecodeError, msgspec.ValidationError, KeyError, TypeError) as e:
            raise ValueError(f"the router's /router/status has no autoscale report: {e}") from None

    async def _scale(self, target: int) -> None:
        headers = {"Authorization": f"Bearer {self.scale_token}"} if self.scale_token else {}
        body = wire_scale.encode(wire_scale.ScaleRequest(data_parallel_size_local=target))
        async with self.session().post(self.supervisor_url + "/scale", data=body, headers={
                **headers, "Content-Type": "application/json"}) as resp:
            answer = await read_aiohttp(resp)
        if resp.status not in (200, 202):
            log.warning("autoscale: the node refused %d ranks (%d): %s", target, resp.status,
                        answer.decode("utf-8", "replace")[:300])
            self.last_decision = f"{self.last_decision} (refused: {resp.status})"

    def state(self) -> AutoscaleState:
        """``deployment.autoscale`` in the health port's /status."""
        now = asyncio.get_running_loop().time()
        p = self.planner.state(now)
        last = self.planner.last
        s: Signals | None = last.signals if last is not None else None
        return AutoscaleState(
            min_ranks=self.s.min_ranks, max_ranks=self.s.max_ranks, interval_s=self.s.interval_s,
            up_after_s=self.s.up_after_s, down_after_s=self.s.down_after_s, cooldown_s=self.s.cooldown_s,
            recommended_ranks=p["recommended_ranks"], above_for_s=p["above_for_s"],  # type: ignore[arg-type]
            below_for_s=p["below_for_s"], cooling=bool(p["cooling"]),  # type: ignore[arg-type]
            decisions=self.planner.decisions, last_decision=self.last_decision, error=self.error,
            ranks=s.ranks if s else None, saturation=s.saturation if s else None,
            token_backlog=s.token_backlog if s else None,
            predicted_ttft_s=_finite(s.predicted_ttft_s) if s else None,
            ttft_target_s=s.ttft_target_s if s else None)


def _finite(x: float) -> float | None:
    return None if x == float("inf") else x


def _why(r: AutoscaleReport, target_utilization: float) -> str:
    s = r.signals
    return (f"recommended {r.recommended_ranks} (saturation {s.saturation:.2f} of {s.ranks} serving ranks "
            f"against {target_utilization:g}, backlog {s.token_backlog} tokens, predicted TTFT "
            f"{s.predicted_ttft_s:.3f} s against {s.ttft_target_s:g} s)")
