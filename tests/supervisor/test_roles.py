"""Ranks by role: `lbd supervise --prefill-ranks/--decode-ranks` gives each rank its KV role, /status names
it, and `lbd route --vllm-pd-disaggregation` in front of the supervisor learns the roles and runs long
prompts in two stages (a prefill rank, then a decode rank), with the answer one rank alone gives."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.engine.config.args import make_parser
from lbd.supervisor.config import parse_args
from support import RouterServer, free_port_run
from support.node import SupervisorNode


def _specs(*extra: str):
    base = free_port_run(4)
    args = ["--host", "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
            "--data-parallel-supervisor-port", str(base + 3), "--data-parallel-size", "3", *extra]
    return parse_args(args, env={}).ranks


def test_roles_become_each_ranks_kv_transfer_config() -> None:
    specs = _specs("--prefill-ranks", "0", "--decode-ranks", "1,2")
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    roles = []
    for s in specs:
        ns = make_parser().parse_args(s.argv[3:])
        roles.append(json.loads(ns.kv_transfer_config)["kv_role"])
    assert roles == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert [s.role for s in _specs()] == ["mixed"] * 3


@pytest.mark.parametrize("flags, needle", [
    (["--prefill-ranks", "0", "--decode-ranks", "0"], "both"),
    (["--prefill-ranks", "5"], "--prefill-ranks"),
    (["--decode-ranks", "x"], "--decode-ranks"),
    (["--prefill-ranks", "0", "--kv-transfer-config",
      '{"kv_connector": "LbdConnector", "kv_role": "kv_both"}'], "drop --kv-transfer-config"),
])
def test_bad_role_flags_exit_2(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Parsed in this process (the CLI's own parse_args: a subprocess per case cost ~2 s each on a loaded
    host); test_bad_role_flags_exit_2_from_the_cli runs `lbd supervise` itself once."""
    with pytest.raises(SystemExit) as e:
        base = free_port_run(3)
        parse_args(["--port", str(base), "--data-parallel-supervisor-port", str(base + 2),
                    "--data-parallel-size", "2", *flags], env={})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_bad_role_flags_exit_2_from_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "lbd", "supervise", "--data-parallel-size", "2",
                          "--prefill-ranks", "0", "--decode-ranks", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "both" in out.stderr, out.stderr


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    logs = tmp_path_factory.mktemp("roles")
    n = SupervisorNode(tiny_llama, 2, "--served-model-name", "tiny", "--prefill-ranks", "0", "--decode-ranks",
                       "1", log=logs / "supervise.log")
    try:
        n.wait_ready(timeout=240)
        yield n
    finally:
        n.close()


def test_status_names_roles_and_the_router_follows_them(node: SupervisorNode, tmp_path: Path) -> None:
    assert [(r["rank"], r["role"]) for r in node.status()["ranks"]] == [(0, "prefill"), (1, "decode")]
    router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--vllm-pd-disaggregation",
                          "--pd-min-prompt-tokens", "32", "--scrape-interval-ms", "100",
                          "--supervisor-poll-interval-s", "0.2", log=tmp_path / "route.log").wait_ready()
    try:
        prompt = f"{uuid.uuid4()} " + "a long shared document about numbers 0123456789 " * 8
        data = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(node.rank_url(0) + "/v1/completions", json=data, timeout=60).json()
        r = httpx.post(router.url + "/v1/completions", json=data, timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["x-lbd-disagg"] == f"pd {node.rank_url(0)}"
        assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    finally:
        router.close()
