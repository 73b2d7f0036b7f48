"""The core side of the multiprocess executor: start the workers, broadcast steps, collect tokens.

Start-up: bind a ZMQ XPUB (broadcast) and a PULL (replies) on abstract ipc addresses, host the TCPStore,
spawn the workers, wait until each has subscribed (XPUB reports subscriptions: no message can be lost to a
slow joiner), send the config, take the smallest block count any worker can hold, send it, wait for every
``ready``. A worker that exits or reports an error during start-up fails the start with its reason.

Steps: ``submit`` broadcasts a batch and returns at once; ``collect`` waits for the sampler's tokens of the
oldest batch (FIFO), at most ``--distributed-timeout-s``. With PP stages, the engine core keeps up to
``max_in_flight`` = PP batches submitted, so stage 0 works on batch n+1 while stage 1 finishes batch n.

Faults: a watchdog thread waits on every worker's pidfd. When one exits, it SIGKILLs the others and calls
``on_failure(reason)`` (the core process exits non-zero there; the front ends then answer 503 and fail their
in-flight requests); without a callback the next ``submit``/``collect`` raises ``WorkerFailure``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TypeVar

import zmq

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.layout import parse_partition
from lbd.engine.config.slices import parallel_config
from lbd.engine.core.host_batch import HostBatch
from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput
from lbd.engine.executor.plan import WorkerPlan, layout_of, plan_workers
from lbd.engine.models.config import load_hf_config
from lbd.wire import executor_messages as X
from lbd.wire.core_messages import SamplingParams

logger = logging.getLogger(__name__)

_POLL_MS = 200
_STOP_GRACE_S = 5.0
W = TypeVar("W", bound=X.FromWorker)


class WorkerFailure(RuntimeError):
    """A worker died, reported an error, or did not answer in time; the rank cannot go on."""


def worker_config(args: EngineArgs, model_path: str, store: tuple[str, int]) -> dict[str, object]:
    """The ``config`` broadcast: everything a worker needs to join the group and load its shard."""
    return {"args": asdict(args), "model_path": model_path, "tp": args.tensor_parallel_size,
            "pp": args.pipeline_parallel_size, "partition": parse_partition(args.pp_layer_partition),
            "store": list(store), "timeout_s": args.distributed_timeout_s,
            "timed": os.environ.get("LBD_PROFILE_COLLECTIVES") == "1" or None}


class MultiprocExecutor:
    """Runner for a TP x PP rank (same attributes as ModelRunner, plus ``submit``/``collect``)."""

    def __init__(self, args: EngineArgs, model_path: str,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.parallel = parallel_config(args)
        self.layout = layout_of(self.parallel)
        self.max_in_flight = self.layout.pp_size
        self.timeout_s = self.parallel.distributed_timeout_s
        self.on_failure = on_failure
        self.failure: str | None = None
        self.plans = plan_workers(self.parallel, load_hf_config(model_path).num_hidden_layers)
        self.procs: list[subprocess.Popen] = []
        self._known: set[str] = set()  # requests the sampler holds state for
        self._next_seq = 0
        self._watchdog: Watchdog | None = None
        self._closed = False
        self.model_path = model_path
        self.lora_enabled = False
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pull = self._ctx.socket(zmq.PULL)
        try:
            self._start(model_path)
        except BaseException:
            self.close()
            raise

    # ---- start-up ------------------------------------------------------------------------------------------
    def _start(self, model_path: str) -> None:
        from lbd.engine.distributed.groups import host_store

        bcast, reply, store_host = self._endpoints()
        for sock, address in ((self._pub, bcast), (self._pull, reply)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.bind(address)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.store = host_store(store_host, self.timeout_s)
        world = self.layout.world_size
        self._launch(self._pub.getsockopt_string(zmq.LAST_ENDPOINT),
                     self._pull.getsockopt_string(zmq.LAST_ENDPOINT))
        self._wait_subscribed(world)
        self._broadcast(X.WorkerConfig(**self._worker_config(model_path, (store_host, self.store.port))))
        reports = self._gather(X.Blocks, world)
        self.num_blocks = min(r.num_blocks for r in reports.values())
        facts = reports[self._sampler_rank].facts
        for key in ("block_size", "max_model_len", "vocab_size", "eos_token_id", "device", "dtype",
                    "max_num_seqs", "max_num_batched_tokens"):
            setattr(self, key, facts[key])
        self._broadcast(X.KVSize(self.num_blocks))
        pids = {rank: r.pid for rank, r in self._gather(X.Ready, world).items()}
        self._watch()
        logger.info("%d workers ready (TP %d x PP %d, pids %s); %d KV blocks for the rank",
                    world, self.layout.tp_size, self.layout.pp_size, [pids[r] for r in range(world)],
                    self.num_blocks)

    # ---- where the workers run (the Ray executor overrides these) -----------------------------------------
    def _endpoints(self) -> tuple[str, str, str]:
        """(broadcast address, reply address, rendezvous host): abstract ipc sockets and loopback here."""
        base = f"ipc://@lbd-exec-{os.getpid()}-{secrets.token_hex(4)}"
        return f"{base}-bcast", f"{base}-reply", "127.0.0.1"

    def _worker_config(self, model_path: str, store: tuple[str, int]) -> dict[str, object]:
        return worker_config(self.args, model_path, store)

    def _launch(self, bcast: str, reply: str) -> None:
        for plan in self.plans:
            self.procs.append(self._spawn(plan, bcast, reply))

    def _watch(self) -> None:
        self._watchdog = Watchdog(self.procs, self.plans, self._fail)
        self._watchdog.start()

    def _dead_worker(self) -> str | None:
        """Why a worker is gone (without waiting), or None."""
        for proc, plan in zip(self.procs, self.plans, strict=False):
            if proc.poll() is not None:
                return (f"worker {plan.world_rank} (pid {proc.pid}, TP rank {plan.tp_rank}, PP rank "
                        f"{plan.pp_rank}) exited with code {proc.returncode}")
        return None

    def _kill_workers(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    def _stop_workers(self, grace_s: float) -> None:
        """After the shutdown broadcast: wait up to ``grace_s`` for every worker, then kill what is left."""
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def _stop_watch(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()

    @property
    def _sampler_rank(self) -> int:
        return self.layout.world_rank(self.layout.pp_size - 1, 0)

    def _spawn(self, plan: WorkerPlan, bcast: str, reply: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "lbd.engine.executor.worker", "--rank", str(plan.world_rank),
                "--tp-rank", str(plan.tp_rank), "--pp-rank", str(plan.pp_rank), "--cpus", plan.cpu_list,
                "--broadcast", bcast, "--results", reply, "--parent-pid", str(os.getpid())]
        env = {**os.environ, "OMP_NUM_THREADS": str(plan.threads)}
        # Same process group as the core (a killpg of the rank reaches them); PR_SET_PDEATHSIG is set by the
        # worker itself, first thing, and checked against --parent-pid.
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)

    def _wait_subscribed(self, world: int) -> None:
        subscribed = 0
        while subscribed < world:
            self._check_alive("while starting")
            if self._pub.poll(_POLL_MS):
                if self._pub.recv()[:1] == b"\x01":
                    subscribed += 1

    def _gather(self, kind: type[W], world: int) -> dict[int, W]:
        """Every worker's answer of type ``kind``, by world rank."""
        got: dict[int, W] = {}
        want = kind.__struct_config__.tag
        while len(got) < world:
            msg = self._recv(None, f"waiting for {want}")
            if not isinstance(msg, kind):
                sent = msg.__struct_config__.tag
                raise WorkerFailure(f"worker {msg.rank} sent {sent!r} while the executor waited for {want!r}")
            got[msg.rank] = msg
        return got

    # ---- steps ---------------------------------------------------------------------------------------------
    def submit(self, out: SchedulerOutput) -> tuple[int, list[str]]:
        self._raise_if_failed()
        seq = self._next_seq
        self._next_seq += 1
        known = self._known
        known.difference_update(out.finished_ids)
        sampling = [s.request for s in out.seqs if s.sample]
        new = [X.NewRequest(r.request_id, r.sampling,
                            r.prompt_token_ids if _needs_prompt(r.sampling) else None, r.output_token_ids)
               for r in sampling if r.request_id not in known]
        known.update(r.request_id for r in sampling)
        host = HostBatch.from_seqs(out.seqs, self.block_size)
        rids = [r.request_id for r in sampling]
        rows, mask = self._grammar_mask(sampling)
        lora = [s.request.lora_slot for s in out.seqs] if self.lora_enabled else []
        self._broadcast(X.Step(seq, host.to_wire(), rids, new, out.finished_ids, rows, mask, lora))
        return seq, rids

    def enable_lora(self, flags: object) -> object:  # LoraFlags -> LoraManager
        """--enable-lora on a TP rank: the adapters' manager lives here, the slots in the workers (which
        attached them at start-up, from the same flags): lbd.engine.lora.remote."""
        import torch

        from lbd.engine.lora.manager import LoraManager
        from lbd.engine.lora.remote import BroadcastDevice
        from lbd.engine.lora.slots import module_shapes
        from lbd.engine.models.config import arch_config

        cfg = arch_config(load_hf_config(self.model_path))
        self.lora_enabled = True
        return LoraManager(flags, BroadcastDevice(self._broadcast), module_shapes(cfg), cfg.num_layers,
                           getattr(torch, self.dtype))

    def _grammar_mask(self, sampling: list[Request]) -> tuple[list[int], bytes]:
        """The structured-output rows' token bitmask, filled here where the matchers are (the core), for
        the sampling worker (lbd.engine.structured; torch is imported only once a request has a grammar)."""
        if not any(r.grammar is not None for r in sampling):
            return [], b""
        from lbd.engine.structured import mask as token_mask

        built = token_mask.build([r.grammar.matcher if r.grammar is not None else None for r in sampling],
                                 self.vocab_size)
        return built.to_wire() if built is not None else ([], b"")

    def collect(self, handle: tuple[int, list[str]]) -> list[SampledToken]:
        seq, rids = handle
        msg = self._recv(self.timeout_s, f"waiting for step {seq}")
        if not isinstance(msg, X.Out) or msg.seq != seq:
            raise WorkerFailure(f"worker {msg.rank} answered {msg!r:.80} for step {seq}")
        return [SampledToken(r, t, lp) for r, t, lp in zip(rids, msg.token_ids, msg.logprobs, strict=True)]

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        return self.collect(self.submit(out))

    def profile(self, reset: bool = True) -> dict[int, dict]:
        """Every worker's counters since the last reset (call with no batch in flight)."""
        self._broadcast(X.Profile(reset))
        return {rank: r.counters for rank, r in self._gather(X.Counters, self.layout.world_size).items()}

    # ---- plumbing ------------------------------------------------------------------------------------------
    def _broadcast(self, msg: X.ToWorker) -> None:
        self._pub.send(X.encode(msg))

    def _recv(self, timeout_s: float | None, what: str) -> X.FromWorker:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._pull.poll(_POLL_MS):
            self._check_alive(what)
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerFailure(f"no answer from the workers within --distributed-timeout-s "
                                    f"{timeout_s:g} ({what})")
        try:
            msg = X.decode_from_worker(self._pull.recv())
        except ValueError as e:
            raise WorkerFailure(f"a worker sent a message the executor cannot read: {e}") from None
        if isinstance(msg, X.WorkerError):
            raise WorkerFailure(f"worker {msg.rank} failed: {msg.reason}")
        return msg

    def _check_alive(self, what: str) -> None:
        self._raise_if_failed()
        dead = self._dead_worker()
        if dead is not None:
            raise WorkerFailure(f"{dead} {what}")

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    def _fail(self, reason: str) -> None:
        """From the watchdog thread: a worker is gone."""
        self.failure = reason
        logger.error("%s: stopping the rank's other workers", reason)
        self._kill_workers()
        if self.on_failure is not None:
            self.on_failure(reason)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Stop the workers (shutdown message, then SIGKILL after a grace period) and free the sockets (once;
        a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch()
        with contextlib.suppress(zmq.ZMQError):
            self._broadcast(X.Shutdown())
        self._stop_workers(_STOP_GRACE_S)
        self._pub.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()


class Watchdog(threading.Thread):
    """Waits on every worker's pidfd; the first exit is reported once through ``report``."""

    def __init__(self, procs: list[subprocess.Popen], plans: list[WorkerPlan],
                 report: Callable[[str], None]) -> None:
        super().__init__(name="executor-watchdog", daemon=True)
        self.fds = {os.pidfd_open(p.pid): (p, plan) for p, plan in zip(procs, plans, strict=True)}
        self.report = report
        self._stop_r, self._stop_w = os.pipe()

    def run(self) -> None:
        ready, _, _ = select.select([*self.fds, self._stop_r], [], [])
        dead = [fd for fd in ready if fd in self.fds]
        if dead:
            proc, plan = self.fds[dead[0]]
            code = proc.wait()
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            self.report(f"worker {plan.world_rank} (pid {proc.pid}, TP rank {plan.tp_rank}, PP rank "
                        f"{plan.pp_rank}) {how}")
        for fd in [*self.fds, self._stop_r]:
            os.close(fd)
        os.close(self._stop_w)

    def stop(self) -> None:
        if self.is_alive():
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
            self.join(2.0)


def _needs_prompt(p: SamplingParams) -> bool:
    """The workers' sampler reads the prompt's ids: a repetition penalty, or output carried in the prompt."""
    return p.repetition_penalty != 1.0 or p.prior_output_tokens > 0
