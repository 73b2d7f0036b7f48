"""Executors: how one rank's core process drives the devices of a tensor/pipeline-parallel rank.

``--distributed-executor-backend mp`` (the default, vLLM's name): the core process (scheduler, once per rank)
starts TP x PP worker processes (``python -m lbd.engine.executor.worker``, one per device; on the CPU each a
slice of the rank's cores), joined in one torch.distributed group (gloo on the CPU, NCCL on CUDA) through a
TCPStore the core hosts on a loopback port the OS picks. Every step's batch reaches every worker in one
broadcast (a ZMQ PUB socket, msgpack of the compact step: ``lbd.wire.executor_messages``); only the last
stage's TP rank 0 samples and sends tokens back. Workers stay in the core's process group and die with it
(PR_SET_PDEATHSIG); a worker that dies takes the rank down (``mp.Watchdog``), a collective that waits longer
than ``--distributed-timeout-s`` raises. With TP x PP = 1 none of this runs: the model runner stays in the
core.

``--distributed-executor-backend ray`` (``ray_executor``): the same workers and wire protocol, placed by Ray:
a placement group of TP x PP bundles (the rank's own under ``--data-parallel-backend ray``), one actor per
bundle that starts the worker process on its node, the broadcast over TCP, so a rank may span nodes. It
runs the model in a Ray-placed worker even with TP x PP = 1 (as vLLM's Ray executor does).

Modules: ``plan`` (which CPUs, devices and layers each worker gets, no
torch), ``mp`` (the core side), ``worker`` (a worker's process and loop), ``stage`` (a worker's model runner),
``ray_plan`` (what follows from where Ray put the workers, pure), ``ray_worker`` (the actor),
``ray_executor`` (the core side on Ray).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbd.engine.config.args import EngineArgs
    from lbd.engine.executor.mp import MultiprocExecutor


def executor_class(args: EngineArgs) -> type[MultiprocExecutor]:
    """The executor of ``--distributed-executor-backend``: ``mp`` or ``ray``."""
    if args.distributed_executor_backend == "ray":
        from lbd.engine.executor.ray_executor import RayExecutor

        return RayExecutor
    if args.distributed_executor_backend != "mp":
        raise ValueError(f"--distributed-executor-backend {args.distributed_executor_backend}: use mp or ray")
    from lbd.engine.executor.mp import MultiprocExecutor

    return MultiprocExecutor


def make_executor(args: EngineArgs, model_path: str,
                  on_failure: Callable[[str], None] | None = None) -> MultiprocExecutor:
    return executor_class(args)(args, model_path, on_failure=on_failure)
