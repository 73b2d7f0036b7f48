"""`lbd supervise --rank-engine vllm` and `--rank-command` with the real vLLM (its CPU build, in .venv-vllm
from `bash scripts/setup-peers.sh vllm`), serving the default model (SmolLM2-135M-Instruct, the converted fp32
folder): two ranks start as independent vLLM instances, `lbd route` sends requests to both (counted by vLLM's
own `vllm:request_success_total`), and a SIGKILLed rank is restarted while the other serves, its EngineCore
and worker gone with it; then a SIGKILL of the supervisor leaves no process of either rank. Skipped, with the
command that installs it, where that venv does not exist. Slow: each vLLM CPU rank takes a minute or more to
start on two shared cores; the timings are printed (pytest -s shows them)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.node import SupervisorNode, gone_within

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
SETUP = "bash scripts/setup-peers.sh vllm"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").exists(),
                       reason=f"vLLM's CPU build is not installed (.venv-vllm): run `{SETUP}`"),
]
# small vLLM CPU ranks: 1 GiB of KV cache each, short sequences, no compile
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
                "--enforce-eager"]
STARTUP_S = 900.0
# probes patient with a CPU engine stalled by its neighbour's start
PROBES = {"interval": 1.0, "timeout": 5.0, "threshold": 5}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """The default model as the safetensors folder lbd converts it to (vLLM reads the Q4_1 GGUF poorly)."""
    from lbd.engine.config.model_files import ModelNotFoundError
    from lbd.engine.loader import resolve_model

    try:
        return resolve_model(None)
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def _env() -> dict[str, str]:
    return {"PATH": f"{VLLM_VENV / 'bin'}:{os.environ['PATH']}", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _served(node: SupervisorNode, rank: int) -> float:
    """vLLM's own count of the requests this rank finished."""
    text = httpx.get(node.rank_url(rank) + "/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


async def _send(url: str, model: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as c:
        return await asyncio.gather(*(c.post(url + "/v1/completions", json={
            "model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
            for _ in range(n)))


def _router(node: SupervisorNode, start_router):
    return start_router("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy", "least_load",
                        "--scrape-interval-ms", "500", "--supervisor-poll-interval-s", "0.5")


async def test_two_real_vllm_ranks_serve_and_restart(model_dir: Path, tmp_path: Path, start_router) -> None:
    model = str(model_dir)
    t0 = time.monotonic()
    node = SupervisorNode(model, 2, "--rank-engine", "vllm", "--dp-supervisor-startup-timeout-s",
                          str(STARTUP_S), "--log-level", "info", log=tmp_path / "vllm.log", env=_env(),
                          engine_flags=ENGINE_FLAGS, **PROBES)
    try:
        node.wait_ready(STARTUP_S)
        ready_s = time.monotonic() - t0
        for r in node.status()["ranks"]:
            assert r["engine"] == "vllm" and "--data-parallel-rank" not in r["command"], r["command"]
        router = _router(node, start_router)
        await router.wait()
        res = await _send(router.url, model, 12)
        assert all(r.status_code == 200 for r in res), [r.text for r in res]
        served = [_served(node, k) for k in (0, 1)]
        assert sum(served) >= 12 and min(served) >= 1, served  # both ranks served, by vLLM's own counter

        old_tree = node.rank_tree(1)  # the API server, its EngineCore and Worker
        assert sum("EngineCore" in _describe(p) for p in old_tree) == 1, [_describe(p) for p in old_tree]
        t_kill = time.monotonic()
        node.signal_rank(1, signal.SIGKILL)
        assert not gone_within(old_tree, 15.0), "rank 1's engine processes outlived its API server"
        node.wait_for(lambda: node.rank(1)["state"] != "ready", 60, "rank 1 seen down")
        during = await _send(router.url, model, 4)  # the other rank serves meanwhile
        assert all(r.status_code == 200 for r in during), [r.text for r in during]
        node.wait_for(lambda: node.rank(1)["restarts"] == 1 and node.rank(1)["state"] == "ready", STARTUP_S,
                      "rank 1 restarted", interval=0.5)
        restart_s = time.monotonic() - t_kill
        after = await _send(router.url, model, 4)
        assert all(r.status_code == 200 for r in after), [r.text for r in after]
        print(f"\nvLLM ranks ready after {ready_s:.0f} s; requests per rank (vllm:request_success_total) "
              f"{served}; rank 1 back {restart_s:.0f} s after SIGKILL", file=sys.stderr)

        # The supervisor SIGKILLed: nothing of its ranks is left, vLLM's own engine processes included. They
        # are found by the tree and by the node's mark (setproctitle overwrites a process's environ area, so
        # vLLM's renamed processes no longer show the mark).
        procs = list({p.pid: p for p in [*node.descendants(), *node.marked_processes()]}.values())
        names = [_describe(p) for p in procs]
        assert sum("EngineCore" in n for n in names) >= 2, names  # what used to outlive the supervisor
        node.proc.send_signal(signal.SIGKILL)
        t_sup = time.monotonic()
        left = gone_within(procs, 15.0)
        assert not left and not node.marked_processes(), [_describe(p) for p in left]
        print(f"{len(procs)} processes of the node ({'; '.join(sorted(names))}) gone "
              f"{time.monotonic() - t_sup:.1f} s after the supervisor's SIGKILL", file=sys.stderr)
    finally:
        node.close()


def _describe(p) -> str:
    """A process's name and the start of its command line (vLLM names its processes VLLM::EngineCore...)."""
    try:
        return f"{p.name()} {' '.join(p.cmdline()[:3])}"
    except Exception:  # noqa: BLE001 - gone meanwhile
        return f"pid {p.pid}"


def test_rank_command_runs_vllms_module_server(model_dir: Path, tmp_path: Path) -> None:
    """The README's --rank-command example for vLLM: the module server of the vLLM venv's Python."""
    template = (f"{VLLM_VENV}/bin/python -m vllm.entrypoints.openai.api_server --model {{model}} "
                "--host {host} --port {port} --dtype float32 --max-model-len 512 --enforce-eager")
    t0 = time.monotonic()
    node = SupervisorNode(model_dir, 1, "--rank-command", template, "--dp-supervisor-startup-timeout-s",
                          str(STARTUP_S), log=tmp_path / "cmd.log", env=_env(),
                          engine_flags=["--device", "cpu"], **PROBES)
    try:
        node.wait_ready(STARTUP_S)
        ready_s = time.monotonic() - t0
        r = httpx.post(node.rank_url(0) + "/v1/completions", timeout=300, json={
            "model": str(model_dir), "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"], r.text
        assert node.rank(0)["engine"] == "command" and _served(node, 0) >= 1
        print(f"\n--rank-command vLLM rank ready after {ready_s:.0f} s", file=sys.stderr)
    finally:
        node.close()


def test_vllms_refusal_of_its_flags_ends_the_crash_loop(model_dir: Path, tmp_path: Path) -> None:
    """vLLM refusing --data-parallel-* for a dense model (exit code 1, a ValueError at config time) is a usage
    error: no restart, the engine's line in the node's reason, exit code 2."""
    template = (f"{VLLM_VENV}/bin/python -m vllm.entrypoints.openai.api_server --model {{model}} "
                "--port {port} --data-parallel-rank {rank} --data-parallel-size 2 --max-model-len 512")
    node = SupervisorNode(model_dir, 1, "--rank-command", template, "--restart-backoff-initial-s", "30",
                          log=tmp_path / "refusal.log", env=_env(), engine_flags=["--device", "cpu"],
                          **PROBES)
    try:
        assert node.proc.wait(STARTUP_S) == 2
        log = node.log_text()
        refusal = "ValueError: Non-MoE models do not support external data parallel mode"
        assert f"rank 0 exited with code 1: {refusal}" in log and "engine usage error" in log, log[-3000:]
        assert log.count("rank 0: started pid") == 1, log[-3000:]
    finally:
        node.close()
