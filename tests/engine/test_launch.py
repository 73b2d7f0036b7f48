"""The launcher: flags, start-up errors, front ends over one core, SIGTERM drain, dead core, SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil
import pytest

from lbd.engine.config.args import make_parser
from lbd.engine.launch import CORE_PROCESS_NAME
from lbd.engine.server.offload import WORKER_PROCESS_NAME
from support import EngineServer, metric_value

STREAM = {"prompt": "Once upon a time", "stream": True, "ignore_eos": True, "temperature": 0,
          "stream_options": {"include_usage": True}}


def start(model: Path, tmp_path: Path, *args: str) -> EngineServer:
    log = tmp_path / "server.log"
    try:
        return EngineServer(model, "--kv-cache-memory-bytes", "32MiB", *args, log=log)
    except Exception as e:
        raise AssertionError(f"server failed to start: {e}\n{log.read_text(errors='replace')[-4000:]}") from e


def run_engine(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lbd.engine", *args], capture_output=True, text=True,
                          timeout=timeout)


class Stream(threading.Thread):
    """A streaming completion read in the background; keeps every SSE payload."""

    def __init__(self, url: str, **body: object) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, {**STREAM, **body}
        self.events: list[object] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.events.append(data if data == "[DONE]" else orjson.loads(data))
                        self.first.set()
        except BaseException as e:  # recorded for the test to look at
            self.error = e
        finally:
            self.first.set()

    def finish_reason(self) -> str | None:
        reasons = [e["choices"][0]["finish_reason"] for e in self.events if isinstance(e, dict)
                   and e.get("choices") and e["choices"][0]["finish_reason"]]
        return reasons[-1] if reasons else None


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def core_pid(launcher_pid: int) -> int:
    kids = [p for p in psutil.Process(launcher_pid).children() if p.name() == CORE_PROCESS_NAME]
    assert len(kids) == 1, [p.cmdline() for p in psutil.Process(launcher_pid).children()]
    return kids[0].pid


def test_help_lists_every_flag_with_its_default() -> None:
    out = subprocess.run([sys.executable, "-m", "lbd", "serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    flags = [s for a in make_parser()._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"]
    for flag in flags:
        assert flag in out.stdout, flag
    assert out.stdout.count("(default:") >= len(flags) - 5


def test_bad_flags_and_missing_model_exit_2(tmp_path: Path) -> None:
    out = run_engine("--api-server-count", "0")
    assert out.returncode == 2 and "--api-server-count" in out.stderr
    out = run_engine("--profile-steps", "-1")
    assert out.returncode == 2 and "--profile-steps" in out.stderr
    out = run_engine("--port", "http")
    assert out.returncode == 2 and "--port" in out.stderr
    out = run_engine("--chat-template", str(tmp_path / "missing.jinja"))
    assert out.returncode == 2 and "--chat-template" in out.stderr
    out = run_engine("--model", str(tmp_path / "missing"))
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "--model" in errors[0], out.stderr


def test_two_front_ends_share_one_core_and_sigkill_leaves_no_orphan(tiny_llama: Path, tmp_path: Path) -> None:
    srv = start(tiny_llama, tmp_path, "--api-server-count", "2")
    try:
        launcher = psutil.Process(srv.proc.pid)
        pids: set[int] = set()
        for i in range(40):
            with httpx.Client(base_url=srv.base_url, timeout=60) as c:  # a new connection each time
                r = c.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
                pids.add(int(r.headers["x-lbd-frontend-pid"]))
            if len(pids) == 2 and i >= 10:
                break
        tree = {p.pid for p in launcher.children(recursive=True)} | {launcher.pid}
        assert len(pids) == 2 and pids <= tree, (pids, tree)
        assert launcher.pid in pids  # front end 0 runs in the launcher itself
        engines = [p for p in launcher.children() if "resource_tracker" not in " ".join(p.cmdline())
                   and p.name() != WORKER_PROCESS_NAME]
        assert len(engines) == 2  # one core + one extra front end (+ front end 0's tokenizer worker)
        for pid in pids:  # front ends stay light: torch is never loaded there
            assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text()
        text = httpx.get(srv.base_url + "/metrics").text  # any front end aggregates every process
        assert metric_value(text, "vllm:time_to_first_token_seconds_count") >= 11

        descendants = launcher.children(recursive=True)
        os.kill(launcher.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(descendants, timeout=2.0)
        alive = [p for p in alive if _running(p)]  # a zombie is dead (waiting for whoever reaps orphans)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:
        srv.close()


def _one_running_one_waiting(url: str, tries: int = 3) -> tuple[Stream, Stream]:
    """A 600-token stream running (~4 s on the sim rank) and a second one queued behind it (--max-num-seqs
    1). On a loaded machine the second may arrive only after the first ended; then both end and it is tried
    again."""
    for _ in range(tries):
        first = Stream(url, max_tokens=600)
        first.start()
        assert first.first.wait(30) and first.status == 200
        second = Stream(url, max_tokens=30)
        second.start()
        while first.is_alive():
            if metric_value(httpx.get(url + "/metrics").text, "vllm:num_requests_waiting") >= 1:
                return first, second
            time.sleep(0.02)
        second.join(30)
    raise AssertionError(f"the second request never waited behind the first in {tries} tries")


# A sim rank for the launcher's own behaviour (admission, drain, a dead core): the same launcher, front end
# and core process, whose decode steps sleep ~6.5 ms whatever the host's load (a 600-token stream runs ~4 s),
# and which starts without torch. 2GiB holds its profile's (Llama-3-8B) KV blocks for 8192 tokens.
SIM = ("--device", "sim", "--kv-cache-memory-bytes", "2GiB")


def test_admission_503_and_sigterm_drains_in_flight_streams(tiny_llama: Path, tmp_path: Path) -> None:
    srv = start(tiny_llama, tmp_path, *SIM, "--max-num-seqs", "1", "--max-num-queued-reqs", "1",
                "--shutdown-timeout", "60")
    try:
        first, second = _one_running_one_waiting(srv.base_url)
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503, r.text
        assert "waiting queue is full" in r.json()["error"]["message"]

        os.kill(srv.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # the listener is closed: no new work
            r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
            if r.status_code == 503:
                raise httpx.HTTPError("503")
        assert srv.proc.wait(90) == 0
        for s, n in ((first, 600), (second, 30)):
            s.join(10)
            assert s.error is None and s.events[-1] == "[DONE]"
            assert s.finish_reason() == "length"
            assert s.events[-2]["usage"]["completion_tokens"] == n  # every token, no error event
        log = srv.log_text()
        assert "SIGTERM received" in log and "core exited" in log
    finally:
        srv.close()


def _until_running(url: str, n: int, stream: Stream) -> None:
    """Until the engine runs ``n`` requests; the stream must still be going (else the test cannot hold)."""
    while metric_value(httpx.get(url + "/metrics").text, "vllm:num_requests_running") < n:
        assert stream.is_alive(), "the stream ended before the second request started running"
        time.sleep(0.01)


def test_dead_core_fails_in_flight_requests_and_health(tiny_llama: Path, tmp_path: Path) -> None:
    srv = start(tiny_llama, tmp_path, *SIM)  # 900 tokens take ~6 s: both requests are in flight at the kill
    try:
        stream = Stream(srv.base_url, max_tokens=900)
        stream.start()
        assert stream.first.wait(30) and stream.status == 200
        result: dict[str, httpx.Response] = {}
        plain = threading.Thread(target=lambda: result.update(r=httpx.post(
            srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 900, "ignore_eos": True},
            timeout=60)))
        plain.start()
        _until_running(srv.base_url, 2, stream)  # not a fixed sleep: on a busy host the stream may end first
        os.kill(core_pid(srv.proc.pid), signal.SIGKILL)
        stream.join(15)
        plain.join(15)
        assert stream.events[-1] == "[DONE]"
        errors = [e for e in stream.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 503
        assert result["r"].status_code == 503 and "core" in result["r"].json()["error"]["message"]
        assert httpx.get(srv.base_url + "/health").status_code == 503
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert srv.proc.poll() is None  # the launcher stays up so a supervisor sees the 503 and restarts it
    finally:
        srv.close()
