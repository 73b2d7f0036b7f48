"""One TP/PP worker process of a rank, started by its core (``lbd.engine.executor.mp``)::

    python -m lbd.engine.executor.worker --rank R --tp-rank T --pp-rank P --cpus 0-1 \\
        --broadcast ipc://@... --results ipc://@... --parent-pid CORE

(the Ray executor starts the same command from a Ray actor, with tcp:// addresses and ``--parent-pid`` the
actor's process: ``lbd.engine.executor.ray_worker``).

The command line is the contract with operators and the supervisor: ``-m lbd.engine.executor.worker`` and
``--rank/--tp-rank/--pp-rank`` identify a worker in ``ps`` and in the supervisor's ``/status``. The worker
sets PR_SET_PDEATHSIG (SIGKILL) first, so it never outlives its core, and ignores SIGTERM/SIGINT: a rank is
stopped through its core (the ``shutdown`` message), or killed whole. It pins itself to ``--cpus``; its
thread count is ``OMP_NUM_THREADS``, which the core sets.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import zmq

from lbd.engine.procutil import freeze_startup_heap, keep_freed_memory, set_pdeathsig
from lbd.wire import executor_messages as X

logger = logging.getLogger("lbd.engine.worker")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lbd.engine.executor.worker")
    for flag in ("--rank", "--tp-rank", "--pp-rank", "--parent-pid"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--cpus", "--broadcast", "--results"):
        p.add_argument(flag, required=True)
    p.add_argument("--device-index", type=int, default=None,
                   help="its CUDA device in CUDA_VISIBLE_DEVICES (default: its index in the rank, "
                        "PP rank x TP + TP rank; the Ray executor passes its node's own order)")
    return p.parse_args(argv)


class Channels:
    def __init__(self, broadcast: str, results: str, rank: int) -> None:
        self.rank = rank
        self.ctx = zmq.Context(io_threads=1)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(broadcast)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(results)

    def recv(self) -> X.ToWorker:
        return X.decode_to_worker(self.sub.recv())

    def send(self, msg: X.FromWorker) -> None:
        self.push.send(X.encode(msg))

    def close(self) -> None:
        self.sub.close(linger=0)
        self.push.close(linger=2000)  # an error report still gets out
        self.ctx.term()


def serve(ch: Channels, ns: argparse.Namespace) -> None:
    """Join the group, load this worker's shard, agree on the KV size, then run steps until shutdown."""
    import torch

    from lbd.engine.config.args import EngineArgs
    from lbd.engine.config.layout import ParallelLayout
    from lbd.engine.core.host_batch import HostBatch
    from lbd.engine.core.runner import resolve_config
    from lbd.engine.distributed.context import ParallelContext
    from lbd.engine.distributed.groups import init_process_groups
    from lbd.engine.executor.stage import StageRunner
    from lbd.engine.lora import remote, slots

    cfg = ch.recv()
    assert isinstance(cfg, X.WorkerConfig), cfg
    args = EngineArgs(**cfg.args)
    logging.getLogger().setLevel(args.log_level.upper())
    layout = ParallelLayout(tp_size=cfg.tp, pp_size=cfg.pp)
    config = resolve_config(args)
    device = torch.device(config.model.device)
    if device.type == "cuda":
        index = ns.device_index
        torch.cuda.set_device(layout.local_index(ns.pp_rank, ns.tp_rank) if index is None else index)
    host, port = cfg.store
    groups = init_process_groups(layout, ns.pp_rank, ns.tp_rank, address=host, port=port, device=device,
                                 timeout_s=cfg.timeout_s, timed=cfg.timed)
    runner = StageRunner(cfg.model_path, config, ParallelContext(layout, ns.pp_rank, ns.tp_rank,
                                                                 cfg.partition, groups))
    if device.type == "cpu":
        from lbd.engine.core.runner import pin_core_thread

        pin_core_thread()  # the kernels' pool (if it started) left this worker's first CPU to this thread
    ch.send(X.Blocks(ns.rank, runner.measure_num_blocks(), runner.facts()))
    kv = ch.recv()
    assert isinstance(kv, X.KVSize), kv
    runner.allocate_kv(kv.num_blocks)
    if config.lora.enable_lora:  # the slots; the core's manager fills them (lbd.engine.lora.remote)
        slots.attach_runner(runner, config.lora)
    freeze_startup_heap()
    ch.send(X.Ready(ns.rank, os.getpid()))
    while True:
        msg = ch.recv()
        if isinstance(msg, X.Step):
            host = HostBatch.from_wire(msg.batch)
            if runner.lora is not None:
                remote.set_step(runner.lora, msg.lora_slots, host.query_lens, runner.torch_device)
            result = runner.step(host, msg.sample_ids, msg.new, msg.finished, (msg.mask_rows, msg.mask))
            if result is not None:
                ch.send(X.Out(ns.rank, msg.seq, *result))
        elif isinstance(msg, X.LoraSlot):
            remote.write_slot(runner.lora, msg)
        elif isinstance(msg, X.Profile):
            ch.send(X.Counters(ns.rank, runner.profile(msg.reset)))
        elif isinstance(msg, X.Shutdown):
            groups.flush_sends()
            return


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    set_pdeathsig(signal.SIGKILL, ns.parent_pid)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from lbd.engine.config.placement import parse_cpus

    os.sched_setaffinity(0, parse_cpus(ns.cpus))
    keep_freed_memory()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, force=True,
        format=f"%(asctime)s worker {ns.rank} (tp {ns.tp_rank} pp {ns.pp_rank})[%(process)d] %(levelname)s "
               "%(name)s: %(message)s")
    ch = Channels(ns.broadcast, ns.results, ns.rank)
    code = 0
    try:
        serve(ch, ns)
    except Exception as e:
        logger.exception("worker %d failed", ns.rank)
        ch.send(X.WorkerError(ns.rank, f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        ch.close()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (torch's takes seconds); sockets are closed
    return code


if __name__ == "__main__":
    sys.exit(main())
