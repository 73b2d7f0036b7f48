"""The Ray actor that holds one bundle of a rank's placement group and runs one TP/PP worker in it.

The actor is only the worker's host on its node: it reports where it runs (``site``), then starts the very
same worker process the mp executor starts (``python -m lbd.engine.executor.worker``, same wire protocol, only
tcp:// addresses) as its child, and answers ``wait`` with the worker's exit code. The worker sets
PR_SET_PDEATHSIG towards the actor, so whatever ends the actor (``ray.kill`` by the core, Ray cleaning up
after a dead core, a SIGKILL of the actor's process) ends the worker too: nothing is left on any node.

The actor is async, so ``start`` runs on its event loop thread, which lives as long as the actor (the
parent-death signal is tied to the thread that started the child). No torch here: the actor stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys

from lbd.engine.executor.ray_plan import ActorSite


class WorkerHost:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    async def site(self) -> ActorSite:
        import ray

        return ActorSite(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                         os.getpid(), tuple(str(g) for g in ray.get_gpu_ids()),
                         tuple(sorted(os.sched_getaffinity(0))))

    async def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start ``python -m lbd.engine.executor.worker ARGS --parent-pid <this actor>``; its pid."""
        argv = [sys.executable, "-m", "lbd.engine.executor.worker", *args, "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        return self.proc.pid

    async def wait(self) -> int:
        """The worker's exit code (negative: the signal that killed it), once it exits."""
        assert self.proc is not None
        return await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)

    async def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
