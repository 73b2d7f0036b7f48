"""The front end takes the slices it reads, not the whole command line: ``frontend_config`` cuts the flags
once, and a front end is built from a few lines of slices, here against a real ``--device sim`` core over
real HTTP."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.common.rank_header import RANK_HEADER
from lbd.engine.config.args import engine_args_from_namespace, make_parser
from lbd.engine.config.slices import FrontendConfig, ModelConfig, frontend_config

# One front end from its slices: the model's served names, a server slice and the rank. It serves until its
# stdin closes, then drains and closes.
FRONT_END = """
import asyncio, sys
from lbd.engine.config.slices import FrontendConfig, ModelConfig, ServerConfig
from lbd.engine.server.app import Frontend

async def main(model_path, address, core_pid, port):
    config = FrontendConfig(model=ModelConfig(served_model_name=["tiny", "alias"]), rank=1,
                            server=ServerConfig(host="127.0.0.1", port=port, max_logprobs=3))
    fe = Frontend(config, model_path, address, core_pid)
    try:
        await fe.connect(60.0)
        await fe.listen()
        print("ready", fe.state.limits.max_logprobs, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await fe.drain()
    finally:
        await fe.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


def test_frontend_config_cuts_the_flags_the_front_end_reads() -> None:
    ns = make_parser().parse_args(["--served-model-name", "a", "b", "--max-logprobs", "3", "--port", "9001",
                                   "--data-parallel-rank", "1", "--data-parallel-size", "2",
                                   "--disable-log-requests", "--api-server-count", "2"])
    cfg = frontend_config(engine_args_from_namespace(ns))
    assert (cfg.model.model_name, cfg.model.model_names, cfg.rank) == ("a", ["a", "b"], 1)
    assert (cfg.server.max_logprobs, cfg.server.port, cfg.server.api_server_count) == (3, 9001, 2)
    assert cfg.observability.disable_log_requests


def test_served_names_default_to_the_model() -> None:
    assert ModelConfig(model="org/m").model_names == ["org/m"]
    assert FrontendConfig().model.model_name == ModelConfig().model_name  # the default model's name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def front_end(tiny_llama: Path) -> Iterator[str]:
    """A sim core and one front end built from slices (FRONT_END); yields the front end's base URL."""
    run_dir = Path(tempfile.mkdtemp(prefix="lbd-fe-slices-", dir="/tmp"))
    (run_dir / "prom").mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(run_dir / "prom"), "PYTHONUNBUFFERED": "1"}
    address, port = f"ipc://{run_dir}/core.sock", _free_port()
    with open(run_dir / "core.log", "wb") as log:
        core = subprocess.Popen([sys.executable, "-m", "lbd.engine.rank_core", "--device", "sim",
                                 "--model-path", str(tiny_llama), "--input-address", address,
                                 "--max-model-len", "512", "--served-model-name", "tiny"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(run_dir / "front_end.log", "wb") as log:
        fe = subprocess.Popen([sys.executable, "-c", FRONT_END, str(tiny_llama), address, str(core.pid),
                               str(port)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                              text=True)
    try:
        line = fe.stdout.readline()  # "ready 3", or EOF when it failed
        logs = (run_dir / "front_end.log").read_text() + (run_dir / "core.log").read_text()
        assert line.split() == ["ready", "3"], line + logs[-4000:]
        yield f"http://127.0.0.1:{port}"
    finally:
        fe.stdin.close()  # the front end drains and exits
        _stop(fe, signal_first=False)
        _stop(core, signal_first=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop(proc: subprocess.Popen, signal_first: bool) -> None:
    if signal_first:
        proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def test_a_front_end_from_a_few_lines_of_slices(front_end: str) -> None:
    with httpx.Client(base_url=front_end, timeout=60) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "alias"]
        r = http.post("/v1/completions", json={"model": "alias", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert (r.json()["model"], r.json()["usage"]["completion_tokens"]) == ("alias", 2)
        r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "logprobs": 4})
        assert r.status_code == 400 and "3" in r.json()["error"]["message"], r.text  # the server slice's cap
        r = http.post("/v1/completions", json={"model": "other", "prompt": "Hello", "max_tokens": 1})
        assert r.status_code == 404, r.text
        r = http.post("/v1/completions", headers={RANK_HEADER: "0"},
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == RANK_HEADER, r.text  # we are rank 1
        assert http.get("/health").status_code == 200
