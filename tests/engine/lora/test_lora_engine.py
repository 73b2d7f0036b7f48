"""LoRA in the engine core (in process): greedy output per adapter equals transformers with the adapter
merged (PEFT's merge), for Llama, Qwen2 and Qwen3, in batches mixing three adapters and the base model; slots
evicted and reloaded when there are fewer slots than adapters; prefix caching keyed by adapter."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from lbd.engine.core.engine_core import EngineCore, RequestRejected
from lbd.engine.kv_events.recorder import EventRecorder
from lbd.engine.rank_core import build_core
from lbd.wire.core_messages import EngineCoreRequest, LoraCommand
from support.lora import ATTENTION, MLP, make_adapter, make_tiny_qwen2, merged_checkpoint
from support.parity import Run, assert_all_close, engine_args, greedy, hf_greedy
from support.tiny import make_tiny_qwen3

ADAPTERS = {"attn": dict(rank=4, alpha=8, targets=("q_proj", "v_proj")),
            "full": dict(rank=8, alpha=16, targets=ATTENTION + MLP),
            "mlp": dict(rank=16, alpha=16, targets=MLP)}


def _adapters(base: Path, root: Path) -> dict[str, Path]:
    return {name: make_adapter(root / name, base, seed=i + 1, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())}


def _core(base: Path, adapters: dict[str, Path], **kw: object) -> EngineCore:
    """An in-process core; with tensor_parallel_size > 1 a TP rank (real worker processes, gloo)."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    return build_core(engine_args(base, enable_lora=True, lora_modules=modules, max_lora_rank=16, **kw),
                      str(base))


def _run(core: EngineCore, jobs: list[tuple[str | None, list[int]]], n: int, prefix: str = "r") -> list[Run]:
    """All jobs (adapter or None, prompt) at once; also records the most adapters one step carried."""
    ids = [f"{prefix}{i}" for i in range(len(jobs))]
    for rid, (lora, prompt) in zip(ids, jobs, strict=True):
        core.add_request(EngineCoreRequest(rid, prompt, greedy(n), None, 0.0, lora_name=lora))
    runs = {rid: Run() for rid in ids}
    core.most_slots_in_a_step = 0
    for _ in range(10_000):
        if not core.has_work():
            break
        outs = core.step()
        step = core.runner.lora.ctx.step if hasattr(core.runner, "lora") else None  # (TP: in the workers)
        if step is not None:
            core.most_slots_in_a_step = max(core.most_slots_in_a_step, len(step.groups))
        for out in outs:
            run = runs[out.request_id]
            run.tokens += out.new_token_ids
            for lp in out.new_logprobs or []:
                run.top.append(dict(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                run.chosen.append(lp.token_logprob)
    return [runs[rid] for rid in ids]


def _check_against_merged(base: Path, tmp: Path, max_loras: int, **kw: object) -> EngineCore:
    adapters = _adapters(base, tmp / "adapters")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 30))] for _ in range(8)]
    names = [None, "attn", "full", "mlp"]
    jobs = [(names[i % 4], p) for i, p in enumerate(prompts)]
    core = _core(base, adapters, max_loras=max_loras, max_cpu_loras=max(max_loras, 2), **kw)
    ours = _run(core, jobs, 8)
    for name in names:
        idx = [i for i, (lora, _) in enumerate(jobs) if lora == name]
        ref_path = base if name is None else merged_checkpoint(base, adapters[name], tmp / f"merged-{name}")
        refs = hf_greedy(ref_path, [prompts[i] for i in idx], [8] * len(idx))
        assert_all_close([ours[i] for i in idx], refs)
    # the adapters do change the output (else the parity above proves nothing)
    assert len({tuple(ours[i].tokens) for i in range(4)} | {tuple(ours[i].tokens) for i in range(4, 8)}) > 4
    return core


def test_llama_three_adapters_and_base_in_one_batch(tiny_llama: Path, tmp_path: Path) -> None:
    core = _check_against_merged(tiny_llama, tmp_path, max_loras=3)
    assert core.most_slots_in_a_step == 3  # one step ran all three adapters (and the base rows)
    state = core.stats().lora
    assert state.free_slots == 0 and sorted(state.device) == ["attn", "full", "mlp"]
    assert state.running == [] and state.waiting == [] and set(state.load_seconds) == set(ADAPTERS)
    core.close()


def test_llama_chunked_prefill_and_preemption(tiny_llama: Path, tmp_path: Path) -> None:
    """16-token steps (prompts prefill in chunks) and 6 KV blocks for 8 requests of up to 3 (preemptions:
    a preempted request gives its slot back and takes one again when readmitted)."""
    core = _check_against_merged(tiny_llama, tmp_path, max_loras=3, max_num_batched_tokens=16,
                                 kv_cache_memory_bytes=6 * 8192, max_model_len=64)
    assert core.scheduler.counters.num_preemptions > 0
    assert not core.loras.users and not core.loras.refs
    core.close()


def test_qwen2_with_fewer_slots_than_adapters(tmp_path: Path) -> None:
    """Two slots for three adapters: the third waits for a slot no running request uses (LRU eviction)."""
    base = make_tiny_qwen2(tmp_path / "qwen2")
    core = _check_against_merged(base, tmp_path, max_loras=2)
    assert core.most_slots_in_a_step == 2
    assert not core.loras.users and not core.loras.refs  # every pin and hold was given back
    core.close()


def test_tp2_three_adapters_and_base(tmp_path: Path) -> None:
    """TP=2 (two worker processes, gloo): each worker holds its shard of every slot (q/k/v and gate/up: its
    rows of B; o and down: its columns of A, the delta joining the all-reduce). Qwen2 (q/k/v biases) with
    one KV head (replicated on both workers: both take the same rows of k/v's B)."""
    base = make_tiny_qwen2(tmp_path / "qwen2", kv_heads=1)
    core = _check_against_merged(base, tmp_path, max_loras=2, tensor_parallel_size=2)
    assert len(core.runner.worker_pids()) == 2
    assert not core.loras.users and not core.loras.refs and core.stats().lora.free_slots == 0
    core.close()


def test_qwen3_three_adapters_and_base(tmp_path: Path) -> None:
    base = make_tiny_qwen3(tmp_path / "qwen3")
    _check_against_merged(base, tmp_path, max_loras=3).close()


def test_a_resumed_stream_continues_under_its_adapter(tiny_llama: Path, tmp_path: Path) -> None:
    """A stream cut after 5 tokens and resumed on another rank (lbd.router's resume: prompt + the tokens
    sent, ``prior_output_tokens``; the same ``model``) ends as the unbroken one did; on that rank the
    adapter sits in another slot under another id. The base model's continuation differs (the adapter is
    applied to the resumed request, not dropped)."""
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    prompt = [random.Random(9).randrange(3, 300) for _ in range(21)]
    first = _core(tiny_llama, {"full": adapters["full"]})
    whole = _run(first, [("full", prompt)], 12)[0]
    first.close()
    other = _core(tiny_llama, {"attn": adapters["attn"], "full": adapters["full"]}, max_loras=2)
    resumed, base = Run(), Run()
    for rid, lora, run in (("res", "full", resumed), ("base", None, base)):
        other.add_request(EngineCoreRequest(rid, prompt + whole.tokens[:5], greedy(7, prior_output_tokens=5),
                                            None, 0.0, lora_name=lora))
        while other.has_work():
            for out in other.step():
                run.tokens += out.new_token_ids
                for lp in out.new_logprobs or []:
                    run.top.append(dict(zip(lp.top_ids, lp.top_logprobs, strict=True)))
                    run.chosen.append(lp.token_logprob)
    assert other.loras.lookup("full").lora_id != 1
    assert_all_close([resumed], [Run(whole.tokens[5:], whole.top[5:], whole.chosen[5:])])
    assert base.tokens != resumed.tokens
    other.close()


def test_prefix_cache_and_kv_events_are_per_adapter(tiny_llama: Path, tmp_path: Path) -> None:
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    core = _core(tiny_llama, adapters, max_loras=2, max_cpu_loras=3)
    recorder = EventRecorder(core.config.block_size)
    core.scheduler.kv.listener = recorder
    prompt = [random.Random(5).randrange(3, 300) for _ in range(40)]  # two full blocks of 16
    full, attn = (_run(core, [(name, prompt)], 6, prefix=name)[0].tokens for name in ("full", "attn"))
    assert full != attn
    assert core.scheduler.kv.prefix_hits == 0  # the second adapter reused no block of the first
    stored = [e for e in recorder.take() if type(e).__name__ == "BlockStored"]
    assert {e.lora_name for e in stored} == {"full", "attn"}
    assert {e.lora_id for e in stored} == {core.loras.lookup(n).lora_id for n in ("full", "attn")}
    keys = {name: {k for e in stored if e.lora_name == name for k in e.block_hashes}
            for name in ("full", "attn")}
    assert not keys["full"] & keys["attn"]
    again = _run(core, [("full", prompt)], 6, prefix="again")[0].tokens
    assert again == full and core.scheduler.kv.prefix_hits == 32  # the same adapter does hit its blocks
    core.close()


def test_unknown_adapter_bad_load_and_unload(tiny_llama: Path, tmp_path: Path) -> None:
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    core = _core(tiny_llama, {"full": adapters["full"]})
    with pytest.raises(RequestRejected) as err:
        core.add_request(EngineCoreRequest("x", [5, 6], greedy(2), None, 0.0, lora_name="nope"))
    assert err.value.status == 404
    dora = make_adapter(tmp_path / "dora", tiny_llama, use_dora=True)
    big = make_adapter(tmp_path / "big", tiny_llama, rank=32, alpha=32)
    for name, path, status, words in (("dora", dora, 400, "DoRA"), ("big", big, 400, "--max-lora-rank 16"),
                                      ("none", tmp_path / "missing", 404, "No adapter found")):
        assert core.lora_command(LoraCommand(name, "load", name, str(path)), "tok") is None  # off the loop
        answers = []
        while not answers:
            core.step()
            answers = core.take_lora_answers()
        ((token, done),) = answers
        assert (token, done.status) == ("tok", status) and words in done.message, done.message
        assert core.loras.lookup(name) is None
    assert core.lora_command(LoraCommand("u", "unload", "full"), "tok").status == 200
    assert core.lora_command(LoraCommand("u", "unload", "full"), "tok").status == 404
    with pytest.raises(RequestRejected):
        core.add_request(EngineCoreRequest("y", [5, 6], greedy(2), None, 0.0, lora_name="full"))
    core.close()


def test_a_request_without_a_slot_does_not_hold_back_the_queue(tiny_llama: Path, tmp_path: Path) -> None:
    """One slot: while "full" runs, an "attn" request waits for the slot, and the base request queued behind
    it runs anyway; "attn" takes the slot once "full" is done (LRU eviction), and nothing leaks."""
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    core = _core(tiny_llama, adapters, max_loras=1, max_cpu_loras=3)
    for rid, lora in (("f", "full"), ("a", "attn"), ("b", None)):
        core.add_request(EngineCoreRequest(rid, [5, 6, 7, 8], greedy(12 if rid == "f" else 4), None, 0.0,
                                           lora_name=lora))
    core.step()
    assert {r.request_id for r in core.scheduler.running} == {"f", "b"}
    assert core.stats().lora.waiting == ["attn"] and core.stats().lora.running == ["full"]
    done: set[str] = set()
    for _ in range(100):
        done |= {o.request_id for o in core.step() if o.finish_reason is not None}
        if not core.has_work():
            break
    assert done == {"f", "a", "b"} and core.stats().lora.device == ["attn"]
    assert not core.loras.users and not core.loras.refs and core.stats().lora.free_slots == 0
    core.close()


def _load(core: EngineCore, name: str, path: Path) -> int:
    assert core.lora_command(LoraCommand(name, "load", name, str(path)), "t") is None
    deadline = time.monotonic() + 60  # the loader thread may be slow on a loaded host
    while time.monotonic() < deadline:
        core.step()
        answers = core.take_lora_answers()
        if answers:
            return answers[0][1].status
        time.sleep(0.001)
    raise AssertionError("no answer")


def test_unload_while_running_and_load_storm_leak_nothing(tiny_llama: Path, tmp_path: Path) -> None:
    """Requests of an adapter unloaded mid-run finish with it; new ones get 404; loads and unloads in a row
    (same names, new weights) between steps break no other request; afterwards every slot is free again."""
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    core = _core(tiny_llama, {"full": adapters["full"]}, max_loras=2, max_cpu_loras=2)
    free_at_start = core.stats().lora.free_slots
    for rid, lora in (("f", "full"), ("b", None)):
        core.add_request(EngineCoreRequest(rid, [5, 6, 7, 8], greedy(20), None, 0.0, lora_name=lora))
    core.step()
    old_id = core.loras.lookup("full").lora_id
    assert core.lora_command(LoraCommand("u", "unload", "full"), "t").status == 200
    with pytest.raises(RequestRejected):
        core.add_request(EngineCoreRequest("late", [5, 6], greedy(2), None, 0.0, lora_name="full"))
    for i in range(6):  # a storm of loads and unloads while "f" and "b" run
        name = ("attn", "mlp")[i % 2]
        assert _load(core, name, adapters[name]) == 200
        assert core.lora_command(LoraCommand("u", "unload", name), "t").status == 200
    finished = set()
    for _ in range(200):
        finished |= {o.request_id for o in core.step() if o.finish_reason == "length"}
        if not core.has_work():
            break
    assert finished == {"f", "b"}
    assert old_id not in core.loras.by_id  # forgotten once its last request finished
    assert not core.loras.users and not core.loras.refs and not core.loras.cpu
    assert core.stats().lora.free_slots == free_at_start == 2
    core.close()


def test_unsupported_model_and_bad_startup_adapter_stop_start_up(tiny_mixtral: Path, tiny_llama: Path,
                                                                 tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MixtralForCausalLM is not supported"):
        EngineCore.from_args(engine_args(tiny_mixtral, enable_lora=True), str(tiny_mixtral))
    dora = make_adapter(tmp_path / "dora", tiny_llama, use_dora=True)
    with pytest.raises(ValueError, match="--lora-modules d: DoRA adapters"):
        _core(tiny_llama, {"d": dora})


def test_a_failed_reload_refuses_its_requests_with_the_reason(tiny_llama: Path, tmp_path: Path) -> None:
    """One adapter in host memory: "attn" was dropped from it for "full"; its file is gone, so a request for
    it is refused (the reason, 404) while a "full" request beside it runs; "attn" stays registered."""
    adapters = _adapters(tiny_llama, tmp_path / "adapters")
    core = _core(tiny_llama, {"attn": adapters["attn"], "full": adapters["full"]}, max_loras=1,
                 max_cpu_loras=1)
    assert core.stats().lora.cpu == ["full"]
    (adapters["attn"] / "adapter_model.safetensors").unlink()
    for rid, lora in (("a", "attn"), ("f", "full")):
        core.add_request(EngineCoreRequest(rid, [5, 6, 7], greedy(3), None, 0.0, lora_name=lora))
    rejected, done = [], set()
    deadline = time.monotonic() + 60
    while core.has_work() and time.monotonic() < deadline:
        done |= {o.request_id for o in core.step() if o.finish_reason is not None}
        rejected += core.take_rejected()
    assert done >= {"f"} and [(rid, status) for rid, _, status in rejected] == [("a", 404)]
    assert "No adapter weights" in rejected[0][1] and core.loras.lookup("attn") is not None
    assert not core.loras.refs and not core.loras.users
    core.close()
