"""EngineCore with the real tiny-Llama runner, and the core process over real ZMQ sockets.

In-process: batching, chunked prefill, prefix hits and preemption under a tiny KV budget must not change any
request's tokens (greedy or seeded). Process: hello/ready, outputs routed to the front end that owns each
request, abort, admission 503, stats when idle, metrics in multiprocess mode, SIGTERM drain, death with the
parent. Process tests use ``--device sim`` (real scheduler and ZMQ, no torch) so they start in a second.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.engine_core import EngineCore, RequestRejected
from lbd.wire import core_messages as CM
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams
from support import metric_value  # tests/ is on sys.path (conftest)

BLOCK_BYTES = 8192  # tiny Llama: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B x 16 tokens


def core_request(rid: str, prompt: list[int], **sampling: object) -> EngineCoreRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    return EngineCoreRequest(rid, prompt, SamplingParams(**sampling), None, time.time())


def run_all(core: EngineCore, reqs: list[EngineCoreRequest], max_steps: int = 5000) -> dict[str, list[int]]:
    for r in reqs:
        core.add_request(r)
    out: dict[str, list[int]] = {}
    steps = 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        assert steps < max_steps
    return out


def workload() -> list[EngineCoreRequest]:
    shared = [(7 * i) % 300 + 3 for i in range(40)]
    reqs = []
    for i in range(10):
        prompt = [(13 * i + 5 * j) % 300 + 3 for j in range(5 + 9 * i)]
        if i % 3 == 0:
            prompt = shared + prompt  # shared prefix: prefix-cache hits
        sampling = {"temperature": 0.8, "seed": 100 + i} if i in (4, 7) else {}
        reqs.append(core_request(f"r{i}", prompt, max_tokens=8 + 2 * i, **sampling))
    return reqs


def test_batching_chunking_prefix_hits_and_preemption_keep_tokens(tiny_llama: Path) -> None:
    solo = EngineCore.from_args(
        EngineArgs(device="cpu", max_model_len=256, kv_cache_memory_bytes=64 * BLOCK_BYTES), str(tiny_llama))
    expected = {}
    for r in workload():  # one request at a time, whole prompt in one step
        expected.update(run_all(solo, [r]))
    assert solo.scheduler.counters.num_preemptions == 0
    tight = EngineCore.from_args(EngineArgs(device="cpu", max_model_len=192, max_num_batched_tokens=48,
                                            kv_cache_memory_bytes=12 * BLOCK_BYTES, max_num_seqs=8),
                                 str(tiny_llama))
    got = run_all(tight, workload())
    s = tight.scheduler
    assert s.counters.num_preemptions > 0, "the workload must preempt"
    assert s.kv.prefix_hits > 0
    for rid, tokens in expected.items():
        assert got[rid] == tokens, rid
    assert s.kv.ref_cnt == [0] * s.kv.num_blocks and tight.stats().kv_cache_usage == 0.0


def test_engine_core_contract(tiny_llama: Path) -> None:
    core = EngineCore.from_args(EngineArgs(device="cpu", max_model_len=128, max_num_queued_reqs=2,
                                           kv_cache_memory_bytes=32 * BLOCK_BYTES), str(tiny_llama))
    info = core.core_info()
    assert (info.max_model_len, info.num_blocks, info.block_size) == (128, 32, 16)
    assert info.max_num_seqs == 128 and info.max_num_batched_tokens == 2048  # CPU defaults (vLLM CPU's)
    assert core.scheduler.config.max_prefill_tokens_with_decodes == 128
    vocab = core.runner.vocab_size
    with pytest.raises(RequestRejected, match="vocab") as e:
        core.add_request(core_request("bad", [1, vocab]))
    assert e.value.status == 400
    core.add_request(core_request("a", list(range(3, 40)), max_tokens=50))
    core.add_request(core_request("b", list(range(3, 40)), max_tokens=50))
    with pytest.raises(RequestRejected, match="Scheduler waiting queue is full") as e:
        core.add_request(core_request("c", [5, 6]))
    assert e.value.status == 503
    outs = core.step()
    assert [o.request_id for o in outs] == ["a", "b"] and all(len(o.new_token_ids) == 1 for o in outs)
    assert core.stats().num_running == 2 and core.stats().kv_cache_usage > 0
    assert core.abort(["a", "zzz"]) == ["a"]
    outs = run_all(core, [])
    assert list(outs) == ["b"] and len(outs["b"]) == 49
    assert not core.has_work() and core.stats().kv_cache_usage == 0.0
    # eos from the runner when the front end sends none
    assert core.runner.eos_token_id is not None


def test_max_model_len_must_fit_the_kv_cache(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        args = EngineArgs(device="cpu", max_model_len=256, kv_cache_memory_bytes=8 * BLOCK_BYTES)
        EngineCore.from_args(args, str(tiny_llama))


# ---- the core process ---------------------------------------------------------------------------------

class FrontEnd:
    """A DEALER speaking the core protocol, as a front end does; it keeps every output it receives."""

    def __init__(self, ctx: zmq.Context, address: str, ident: bytes) -> None:
        self.ident = ident
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, ident)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sent: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}

    def send(self, kind: bytes, obj: object) -> None:
        if kind == CM.ADD:
            self.sent.add(obj.request_id)
        self.sock.send_multipart([kind, CM.encode(obj)])

    def recv(self, timeout: float = 30.0) -> tuple[bytes, object]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"{self.ident!r}: nothing from the core in {timeout}s")
        kind, payload = self.sock.recv_multipart()
        body = CM.decode(kind, payload)
        if kind == CM.OUTPUTS:
            for o in body.outputs:
                assert o.request_id in self.sent, f"{self.ident!r} got {o.request_id}, not its own"
                assert o.request_id not in self.reasons, f"output after the end of {o.request_id}"
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason:
                    self.reasons[o.request_id] = o.finish_reason
        return kind, body

    def recv_kind(self, want: bytes, timeout: float = 30.0) -> object:
        """The next message of kind ``want`` (outputs on the way are kept)."""
        deadline = time.monotonic() + timeout
        while True:
            kind, body = self.recv(max(deadline - time.monotonic(), 0.01))
            if kind == want:
                return body

    def hello(self, timeout: float = 60.0) -> CM.CoreInfo:
        self.send(CM.HELLO, CM.Hello())
        return self.recv_kind(CM.READY, timeout)

    def collect(self, ids: set[str], timeout: float = 60.0) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Receive until every id in ``ids`` finished; their tokens and finish reasons."""
        deadline = time.monotonic() + timeout
        while not ids <= set(self.reasons):
            self.recv(max(deadline - time.monotonic(), 0.01))
        return {i: self.tokens[i] for i in ids}, {i: self.reasons[i] for i in ids}

    def close(self) -> None:
        self.sock.close(0)


class CoreProc:
    def __init__(self, model: Path, *flags: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="lbd-core-", dir="/tmp"))
        self.address = f"ipc://{self.dir}/core.sock"
        self.metrics_dir = self.dir / "prom"
        self.metrics_dir.mkdir()
        self.log = self.dir / "core.log"
        argv = [sys.executable, "-m", "lbd.engine.rank_core", "--device", "sim",
                "--model-path", str(model),
                "--input-address", self.address, *flags]
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir), "PYTHONUNBUFFERED": "1"}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.ctx = zmq.Context()

    def front_end(self, ident: bytes) -> FrontEnd:
        return FrontEnd(self.ctx, self.address, ident)

    def metrics(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.metrics_dir))
        return generate_latest(registry).decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def core_proc(tiny_llama: Path) -> Iterator[CoreProc]:
    proc = CoreProc(tiny_llama, "--max-model-len", "512", "--data-parallel-rank", "1",
                    "--data-parallel-size", "2", "--served-model-name", "tiny")
    try:
        yield proc
    finally:
        proc.close()


def test_core_process_serves_two_front_ends(core_proc: CoreProc) -> None:
    fe0, fe1 = core_proc.front_end(b"fe0"), core_proc.front_end(b"fe1")
    try:
        info = fe0.hello()
        assert (info.device, info.max_model_len, info.block_size) == ("sim", 512, 16)
        assert fe1.hello(10).num_blocks == info.num_blocks
        prefix = list(range(3, 67))  # 64 tokens = 4 blocks
        fe0.send(CM.ADD, core_request("p0", prefix + [70, 71], max_tokens=5))
        assert fe0.collect({"p0"})[1] == {"p0": "length"}
        for i in range(3):
            fe0.send(CM.ADD, core_request(f"a{i}", prefix + [80 + i] * 3, max_tokens=20 + i))
            fe1.send(CM.ADD, core_request(f"b{i}", [90 + i] * 30, max_tokens=10 + i))
        tok0, why0 = fe0.collect({"a0", "a1", "a2"})
        tok1, why1 = fe1.collect({"b0", "b1", "b2"})
        assert {k: len(v) for k, v in tok0.items()} == {"a0": 20, "a1": 21, "a2": 22}
        assert {k: len(v) for k, v in tok1.items()} == {"b0": 10, "b1": 11, "b2": 12}
        assert set(why0.values()) == set(why1.values()) == {"length"}
        # Idle: stats reach every front end and show an empty core.
        stats = fe1.recv_kind(CM.STATS, 5)
        assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
        # An idle core sleeps in poll: it must not spin.
        cpu = psutil.Process(core_proc.proc.pid)
        before = sum(cpu.cpu_times()[:2])
        time.sleep(1.0)
        assert sum(cpu.cpu_times()[:2]) - before < 0.2
        # Metrics, written by the core in multiprocess mode with the rank's labels.
        text = core_proc.metrics()
        lab = {"model_name": "tiny", "engine": "1"}
        assert metric_value(text, "vllm:prefix_cache_hits_total", **lab) >= 3 * 64
        assert metric_value(text, "vllm:prefix_cache_queries_total", **lab) == 66 + 3 * 67 + 3 * 30
        assert metric_value(text, "vllm:request_success_total", finished_reason="length", **lab) == 7
        assert metric_value(text, "vllm:generation_tokens_total", **lab) == 5 + 63 + 33
        assert metric_value(text, "vllm:prompt_tokens_total", **lab) == 66 + 3 * 67 + 3 * 30
        assert metric_value(text, "vllm:num_requests_running", **lab) == 0
        assert metric_value(text, "vllm:cache_config_info", block_size="16", enable_prefix_caching="True",
                            num_gpu_blocks=str(info.num_blocks), engine="1") == 1
    finally:
        fe0.close()
        fe1.close()


def test_core_process_abort_and_bad_messages(core_proc: CoreProc) -> None:
    fe = core_proc.front_end(b"fe")
    try:
        fe.hello()
        fe.send(CM.ADD, core_request("long", list(range(3, 50)), max_tokens=400))
        assert fe.recv_kind(CM.OUTPUTS).stats.num_running == 1
        fe.sock.send_multipart([CM.ADD, b"\xc1garbage"])  # undecodable: dropped, core lives
        fe.sock.send_multipart([CM.ADD, msgpack.packb({"request_id": "x"})])  # missing fields
        fe.sock.send_multipart([b"bogus", b""])
        fe.sock.send_multipart([CM.ABORT, msgpack.packb(["long"])])  # not an Abort: dropped
        fe.send(CM.ABORT, CM.Abort(["long", "never-seen"]))
        deadline = time.monotonic() + 10
        while True:  # outputs already sent may still arrive, then stats show the core empty
            kind, body = fe.recv(max(deadline - time.monotonic(), 0.01))
            stats = body.stats if kind == CM.OUTPUTS else body
            if stats.num_running == 0 and stats.kv_cache_usage == 0.0:
                break
        assert "long" not in fe.reasons and len(fe.tokens["long"]) < 400  # no output after an abort
        fe.send(CM.ADD, core_request("short", [5, 6, 7], max_tokens=3))
        assert fe.collect({"short"})[1] == {"short": "length"}
        assert core_proc.proc.poll() is None
        text = core_proc.metrics()
        assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == 1
    finally:
        fe.close()


def test_core_process_admission_503_and_sigterm_drain(tiny_llama: Path) -> None:
    core = CoreProc(tiny_llama, "--max-model-len", "512", "--max-num-seqs", "1", "--max-num-queued-reqs", "1")
    fe = core.front_end(b"fe")
    try:
        fe.hello()
        fe.send(CM.ADD, core_request("r1", [5] * 20, max_tokens=150))  # ~1 s of simulated decode
        fe.recv_kind(CM.OUTPUTS)  # r1 runs
        fe.send(CM.ADD, core_request("r2", [6] * 20, max_tokens=5))  # waits (max_num_seqs 1)
        fe.send(CM.ADD, core_request("r3", [7] * 20, max_tokens=5))  # the queue is full
        body = fe.recv_kind(CM.ERROR)
        assert body.request_id == "r3" and body.status == 503
        assert "Scheduler waiting queue is full" in body.message
        core.proc.send_signal(signal.SIGTERM)  # drain: r1 and r2 finish, then exit 0
        tokens, reasons = fe.collect({"r1", "r2"})
        assert len(tokens["r2"]) == 5 and len(tokens["r1"]) >= 140
        assert core.proc.wait(20) == 0
        assert not Path(core.address.removeprefix("ipc://")).exists()
    finally:
        fe.close()
        core.close()


def test_core_process_dies_with_its_parent(tiny_llama: Path) -> None:
    d = Path(tempfile.mkdtemp(prefix="lbd-core-", dir="/tmp"))
    parent_code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'lbd.engine.rank_core', '--device', 'sim',"
        f" '--model-path', {str(tiny_llama)!r}, '--input-address', 'ipc://{d}/core.sock'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE)
    child = 0
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not (d / "core.sock").exists():  # bound: the core is up
            assert time.monotonic() < deadline, "core never bound its socket"
            time.sleep(0.05)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the core outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait(10)
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
