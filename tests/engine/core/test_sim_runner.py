"""The simulated accelerator: profiles, deterministic tokens, step times that follow the profile."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lbd.engine.config.args import EngineArgs
from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import ScheduledSeq, SchedulerOutput
from lbd.engine.core.sim_runner import SimRunner, read_model_facts, step_shape
from lbd.engine.sim_profiles import PROFILES, StepShape, UnknownProfileError, get_profile
from lbd.wire.core_messages import SamplingParams

H100 = PROFILES["h100-llama3-8b"]


def _request(
    rid: str,
    prompt: list[int],
    computed: int = 0,
    outputs: list[int] | None = None,
    logprobs: int | None = None,
) -> Request:
    r = Request(
        rid, prompt, SamplingParams(max_tokens=64, logprobs=logprobs), eos_token_id=2, arrival_time=0.0
    )
    for t in outputs or []:
        r.append_token(t)
    r.num_computed_tokens = computed
    return r


def test_h100_profile_arithmetic() -> None:
    # batch-1 decode is weight-bandwidth bound: 16.06 GB at 80% of 3.35 TB/s plus 0.5 ms host time
    decode = H100.step_time(StepShape(decode_seqs=1, kv_tokens_read=1))
    expected = 0.5e-3 + 10e-6 + (16.06e9 + 131072) / (0.8 * 3.35e12)
    assert decode == pytest.approx(expected, rel=1e-9)
    assert 6e-3 < decode < 7e-3
    # a long prefill is compute bound: 2 * 8.03e9 FLOP per token at 55% of 989 TFLOP/s
    n = 8192
    prefill = H100.step_time(
        StepShape(prefill_tokens=n, prefill_seqs=1, kv_tokens_read=n, attn_pairs=n * (n + 1) // 2)
    )
    flops = n * 2 * 8.03e9 + n * (n + 1) // 2 * 4 * 32 * 4096
    assert prefill == pytest.approx(0.5e-3 + 10e-6 + flops / (0.55 * 989e12), rel=1e-9)
    # KV capacity at 0.9 utilisation: ~434k tokens of 128 KiB
    blocks = H100.num_blocks(16, 0.9)
    assert 430_000 < blocks * 16 < 440_000
    assert H100.num_blocks(16, 0.9, kv_bytes=131072 * 16 * 10) == 10
    # more KV read or a bigger batch never makes a step faster
    assert H100.step_time(StepShape(decode_seqs=64, kv_tokens_read=64_000)) > decode
    assert H100.step_time(StepShape()) == 0.0


def test_profile_specs(tmp_path: Path) -> None:
    assert get_profile("h100-llama3-8b*10").time_scale == 10
    shape = StepShape(decode_seqs=4, kv_tokens_read=4000)
    assert get_profile("h100-llama3-8b*10").step_time(shape) == pytest.approx(10 * H100.step_time(shape))
    for bad in ("nope", "h100-llama3-8b*0", "h100-llama3-8b*x"):
        with pytest.raises(UnknownProfileError, match="--sim-profile"):
            get_profile(bad)
    fields = {
        k: getattr(H100, k) for k in H100.__dataclass_fields__ if k not in ("name", "description", "source")
    }
    fields["peak_bandwidth"] = H100.peak_bandwidth / 2
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(fields))
    mine = get_profile(f"{path}*2")
    assert mine.name == "measured" and mine.time_scale == 2
    assert mine.step_time(StepShape(decode_seqs=1, kv_tokens_read=1)) > 2 * H100.step_time(
        StepShape(decode_seqs=1, kv_tokens_read=1)
    )
    path.write_text(json.dumps({**fields, "bogus": 1}))
    with pytest.raises(UnknownProfileError, match="bogus"):
        get_profile(str(path))


def test_step_shape_counts_prefill_decode_and_kv() -> None:
    prompt = list(range(3, 103))  # 100 tokens
    chunk = _request("a", prompt, computed=32)  # 32 cached, 68 to compute
    decode = _request("b", prompt, computed=101, outputs=[7, 8])  # computing its 2nd output token
    out = SchedulerOutput(seqs=[ScheduledSeq(decode, 1, True), ScheduledSeq(chunk, 68, True)])
    shape = step_shape(out)
    assert shape.decode_seqs == 1 and shape.prefill_tokens == 68 and shape.prefill_seqs == 1
    assert shape.kv_tokens_read == 102 + 100
    assert shape.attn_pairs == 102 + (68 * 32 + 68 * 69 // 2)


def test_runner_attributes_and_deterministic_words(tiny_llama: Path) -> None:
    args = EngineArgs(device="sim", sim_profile="h100-llama3-8b", seed=0)
    runner = SimRunner.from_args(args, tiny_llama)
    facts = read_model_facts(tiny_llama)
    config = json.loads((tiny_llama / "config.json").read_text())
    assert runner.vocab_size == config["vocab_size"] and runner.eos_token_id == config["eos_token_id"]
    assert runner.device == "sim" and runner.block_size == 16 and runner.max_model_len == 8192
    assert runner.num_blocks == H100.num_blocks(16, 0.9)
    assert runner.eos_token_id not in facts.word_ids and len(facts.word_ids) >= 2

    def generate(r: SimRunner, rid: str, prompt: list[int], n: int) -> list[int]:
        req = _request(rid, prompt)
        out = SchedulerOutput(seqs=[ScheduledSeq(req, len(prompt), True)])
        for _ in range(n):
            (tok,) = r.execute(out)
            assert tok.request_id == rid
            req.num_computed_tokens = req.num_tokens
            req.append_token(tok.token_id)
            out = SchedulerOutput(seqs=[ScheduledSeq(req, 1, True)])
        return req.output_token_ids

    fast = EngineArgs(device="sim", sim_profile="h100-llama3-8b*0.01")
    first = generate(SimRunner.from_args(fast, tiny_llama), "x", [5, 6, 7, 8], 40)
    again = generate(SimRunner.from_args(fast, tiny_llama), "y", [5, 6, 7, 8], 40)
    other = generate(SimRunner.from_args(fast, tiny_llama), "z", [5, 6, 7, 9], 40)
    assert first == again  # same prompt, same text, whatever the request id or the process
    assert first != other
    assert all(t in facts.word_ids for t in first) and len(set(first)) > 5
    reseeded = generate(
        SimRunner.from_args(EngineArgs(device="sim", sim_profile="h100-llama3-8b*0.01", seed=1), tiny_llama),
        "x",
        [5, 6, 7, 8],
        40,
    )
    assert reseeded != first


def test_runner_logprobs(tiny_llama: Path) -> None:
    runner = SimRunner.from_args(EngineArgs(device="sim", sim_profile="h100-llama3-8b*0.01"), tiny_llama)
    req = _request("lp", [5, 6, 7], logprobs=3)
    (tok,) = runner.execute(SchedulerOutput(seqs=[ScheduledSeq(req, 3, True)]))
    assert tok.logprobs is not None and tok.logprobs.top_ids[0] == tok.token_id
    assert len(tok.logprobs.top_ids) == 3 == len(set(tok.logprobs.top_ids))
    assert tok.logprobs.top_logprobs == sorted(tok.logprobs.top_logprobs, reverse=True)


def test_step_times_follow_the_profile_within_10_percent(tiny_llama: Path) -> None:
    # Dilate time 10x so every step is >= 65 ms: timer and scheduling noise stay far below 10%.
    runner = SimRunner.from_args(EngineArgs(device="sim", sim_profile="h100-llama3-8b*10"), tiny_llama)
    profile = runner.profile
    prompt = list(range(3, 2003))
    cases = {
        "prefill 2000": SchedulerOutput(seqs=[ScheduledSeq(_request("p", prompt), 2000, True)]),
        "prefill chunk after 1500 cached": SchedulerOutput(
            seqs=[ScheduledSeq(_request("c", prompt, computed=1500), 500, True)]
        ),
        "decode x1": SchedulerOutput(seqs=[ScheduledSeq(_request("d", prompt, 2000, [9]), 1, True)]),
        "decode x64 + prefill 256": SchedulerOutput(
            seqs=[
                *(ScheduledSeq(_request(f"d{i}", prompt, 2000, [9]), 1, True) for i in range(64)),
                ScheduledSeq(_request("q", prompt[:256]), 256, True),
            ]
        ),
    }
    for name, out in cases.items():
        expected = profile.step_time(step_shape(out))
        t0 = time.perf_counter()
        sampled = runner.execute(out)
        took = time.perf_counter() - t0
        assert len(sampled) == len(out.seqs)
        assert runner.last_step_s == pytest.approx(expected)
        assert expected * 0.999 <= took <= expected * 1.10, (
            f"{name}: {took * 1e3:.1f} ms vs {expected * 1e3:.1f} ms"
        )
    # finished requests drop their state
    runner.execute(SchedulerOutput(finished_ids=["p", "c", "d", "q", *(f"d{i}" for i in range(64))]))
    assert runner._keys == {}


def test_sim_modules_do_not_import_torch() -> None:
    code = (
        "import sys, lbd.engine.core.sim_runner, lbd.engine.sim_profiles; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[3]).returncode == 0


# ---- whole engines ---------------------------------------------------------------------------------------


def _one_request(base_url: str) -> None:
    import httpx

    body = {"model": "m", "prompt": "Hello world, how are you", "max_tokens": 5, "stream": True}
    models = httpx.get(base_url + "/v1/models", timeout=10).json()
    body["model"] = models["data"][0]["id"]
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert any("[DONE]" in line for line in r.iter_lines())


def test_sim_engine_latencies_follow_the_profile(tiny_llama: Path, tmp_path: Path) -> None:
    """Through the real front end, scheduler and ZMQ: TTFT ~ one prefill step, ITL ~ one decode step."""
    from support import EngineServer

    spec = "h100-llama3-8b*20"  # steps of 130-650 ms: host overheads of a few ms stay well inside 10%
    profile = get_profile(spec)
    out = tmp_path / "r.json"
    with EngineServer(
        tiny_llama, "--device", "sim", "--sim-profile", spec, log=tmp_path / "sim.log"
    ) as server:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "lbd",
                "bench",
                "--base-url",
                server.base_url,
                "--tokenizer",
                str(tiny_llama),
                "--num-prompts",
                "2",
                "--max-concurrency",
                "1",
                "--input-len",
                "1000",
                "--output-len",
                "12",
                "--no-progress",
                "--result-json",
                str(out),
            ],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parents[3],
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr
    for r in json.loads(out.read_text())["runs"][0]["requests"]:
        p, n = r["prompt_tokens"], r["output_tokens"]
        assert p > 900 and n == 12
        prefill = profile.step_time(
            StepShape(prefill_tokens=p, prefill_seqs=1, kv_tokens_read=p, attn_pairs=p * (p + 1) // 2)
        )
        decodes = [
            profile.step_time(StepShape(decode_seqs=1, kv_tokens_read=p + i + 1, attn_pairs=p + i + 1))
            for i in range(1, n)
        ]
        assert prefill <= r["ttft"] <= prefill * 1.10, (r["ttft"], prefill)
        mean_itl, expected_itl = sum(r["itl"]) / len(r["itl"]), sum(decodes) / len(decodes)
        assert len(r["itl"]) == n - 1
        assert expected_itl * 0.98 <= mean_itl <= expected_itl * 1.10, (mean_itl, expected_itl)


@pytest.mark.slow
def test_sixteen_sim_ranks_fit_two_cores_under_the_supervisor(tiny_llama: Path, tmp_path: Path) -> None:
    import httpx

    from support import free_port, free_port_run, spawn, stop, tree_usage, wait_http

    n, sup = 16, free_port()
    base = free_port_run(n)
    ports = [base + i for i in range(n)]
    argv = [sys.executable, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
            "--data-parallel-size", str(n), "--data-parallel-size-local", str(n), "--host", "127.0.0.1",
            "--port", str(base), "--data-parallel-supervisor-port", str(sup), "--device", "sim",
            "--model", str(tiny_llama), "--log-level", "warning"]
    proc = spawn(argv, log=tmp_path / "supervise.log")
    try:
        wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=420, proc=proc)
        status = httpx.get(f"http://127.0.0.1:{sup}/status", timeout=10).json()
        assert [r["state"] for r in status["ranks"]] == ["ready"] * n
        for port in ports:
            _one_request(f"http://127.0.0.1:{port}")
        before, _ = tree_usage(proc.pid)
        time.sleep(5.0)
        after, rss = tree_usage(proc.pid)
        idle_share = (after - before) / 5.0  # in cores
        rss_gib = rss / 2**30
        # idle cores block on their sockets and front ends on their event loops: 16 ranks stay < 0.3 core
        print(f"16 idle sim ranks: {idle_share:.3f} cores, {rss_gib:.2f} GiB RSS")
        assert idle_share < 0.3, f"16 idle sim ranks use {idle_share:.2f} cores"
        assert rss_gib < 8.0, f"16 sim ranks hold {rss_gib:.1f} GiB"
        text = httpx.get(f"http://127.0.0.1:{ports[-1]}/metrics", timeout=10).text
        assert 'engine="15"' in text
    finally:
        stop(proc, timeout=60)


def test_prefix_cache_hits_shorten_the_simulated_prefill(tiny_llama: Path) -> None:
    """With the real scheduler and prefix cache: a repeated prompt's prefill step only computes the miss."""
    from lbd.engine.core.engine_core import EngineCore
    from lbd.wire.core_messages import EngineCoreRequest

    args = EngineArgs(device="sim", sim_profile="h100-llama3-8b*0.01", max_num_batched_tokens=8192)
    core = EngineCore.from_args(args, str(tiny_llama))
    assert isinstance(core.runner, SimRunner)
    prompt = [3 + i % 300 for i in range(40 * 16 + 5)]  # 645 tokens: 40 full blocks and a partial one
    shapes: dict[str, list[StepShape]] = {}
    for rid in ("first", "again"):
        sampling = SamplingParams(max_tokens=3, ignore_eos=True)
        core.add_request(EngineCoreRequest(rid, prompt, sampling, None, 0.0))
        shapes[rid] = []
        texts: list[int] = []
        while core.has_work():
            for o in core.step():
                texts += o.new_token_ids
            shapes[rid].append(core.runner.last_shape)
        assert len(texts) == 3
    cold, warm = shapes["first"][0], shapes["again"][0]
    assert cold.prefill_tokens == len(prompt)
    assert warm.prefill_tokens == len(prompt) - 40 * 16  # only the partial block is computed again
    assert warm.kv_tokens_read == cold.kv_tokens_read == len(prompt)
    profile = core.runner.profile
    assert profile.step_time(warm) < profile.step_time(cold)
