"""--profile-steps: the step profiler's accounting, its hooks in a real EngineCore (the kernels are timed
while on and unwrapped after), and the lines a real server's core and front end log."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.core.step_profile import NO_PROFILE, StepProfiler, parse_line
from lbd.kernels import ops
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams
from support import EngineServer


def test_laps_kinds_and_windows() -> None:
    lines: list[str] = []
    prof = StepProfiler(2, sink=lines.append)
    for decode_only in (True, False):
        prof.begin()
        time.sleep(0.002)
        prof.lap("schedule")
        prof.ops["linear"] = 0.001  # as the op timer records during the forward
        time.sleep(0.002)
        prof.lap("forward")
        prof.shape(4, 4 if decode_only else 40, decode_only)
        prof.end()
    assert len(lines) == 2  # one window of 2 steps: one line per kind
    rows = {d["kind"]: d for d in map(parse_line, lines)}
    assert set(rows) == {"decode", "mixed"} and rows["decode"]["label"] == "core"
    d = {k: float(v) for k, v in rows["mixed"].items() if k not in ("label", "kind")}
    assert d["steps"] == 1 and d["tokens"] == 40 and d["schedule"] >= 1.5 and d["forward_linear"] == 1.0
    assert abs(d["forward"] - d["forward_linear"] - d["forward_other"]) < 0.02
    assert d["step_ms"] >= d["schedule"] + d["forward"] - 0.02
    assert "idle_or_loop" in rows["mixed"]  # the gap after the first step


def test_no_step_without_a_shape_and_idle_gaps_are_not_loop_time() -> None:
    lines: list[str] = []
    prof = StepProfiler(1, sink=lines.append)
    prof.begin()
    prof.end()  # nothing scheduled
    assert lines == []
    prof.begin()
    prof.shape(1, 1, True)
    prof.end()
    prof.idle()
    prof.begin()
    prof.shape(1, 1, True)
    prof.end()
    assert len(lines) == 2 and "idle_or_loop" not in lines[1]


def test_engine_core_profiles_its_steps_and_unwraps_the_kernels(tiny_llama: Path, caplog) -> None:
    original = ops.linear
    args = EngineArgs(model=str(tiny_llama), kv_cache_memory_bytes=16 << 20, profile_steps=3)
    core = EngineCore.from_args(args, str(tiny_llama))
    try:
        assert ops.linear is not original and ops.linear.__wrapped__ is original
        caplog.set_level("INFO", logger="lbd.engine.profile")
        for i in range(3):
            core.add_request(EngineCoreRequest(f"r{i}", list(range(5, 40 + i)),
                                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                               None, 0.0))
        while core.has_work():
            core.step()
    finally:
        core.stop_profiling()
    assert ops.linear is original and core.profiler is NO_PROFILE
    rows = [parse_line(r.getMessage()) for r in caplog.records if "step profile" in r.getMessage()]
    decode = [r for r in rows if r.get("kind") == "decode"]
    assert decode
    assert all(float(r["forward_linear"]) > 0 and float(r["forward_attention"]) > 0 for r in decode)
    assert all(float(r["seqs"]) == 3 for r in decode)
    for key in ("schedule", "prepare", "forward_other", "lm_head", "sample", "update"):
        assert key in decode[0], key


def test_server_core_and_front_end_log_their_breakdown(tiny_llama: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with EngineServer(tiny_llama, "--kv-cache-memory-bytes", "32MiB", "--profile-steps", "4", log=log) as srv:
        body = {"prompt": "hello there", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 10
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "[frontend" not in log.read_text():
            time.sleep(0.1)
    rows = [parse_line(x) for x in log.read_text().splitlines() if "step profile" in x]
    core = [r for r in rows if r["label"] == "core"]
    front = [r for r in rows if r["label"].startswith("frontend")]
    assert core and {"ipc_in", "ipc_out", "forward_linear"} <= set(core[-1])
    assert front and float(front[0]["tokens"]) > 0
    keys = {"detokenize_us_per_token", "stream_us_per_token", "ipc_us_per_token", "cpu_cores"}
    assert keys <= set(front[0])
