"""`lbd bench` pieces that need no server: statistics, SLOs, workloads, flag errors."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from lbd.bench.client import RequestRecord
from lbd.bench.stats import SloError, parse_slo, percentile, summarize, timeline
from lbd.bench.tokenizer import load_tokenizer
from lbd.bench.workloads import (
    TextSource,
    WorkloadError,
    WorkloadSpec,
    chat_messages,
    completion_prompt,
    sessions,
)

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def src(tiny_llama: Path) -> TextSource:
    return TextSource(load_tokenizer(str(tiny_llama)))


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_percentile_matches_linear_interpolation() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_parse_slo_units_and_errors() -> None:
    assert parse_slo("ttft=500,itl=50") == {"ttft": 0.5, "itl": 0.05}
    assert parse_slo("e2e=2s, tpot=20ms") == {"e2e": 2.0, "tpot": 0.02}
    assert parse_slo(None) == {}
    for bad in ("ttft", "foo=1", "ttft=abc", "ttft=-1"):
        with pytest.raises(SloError, match="--slo"):
            parse_slo(bad)


def test_summary_counts_goodput_and_timeline() -> None:
    recs = []
    for i in range(10):
        r = RequestRecord(
            f"s{i}",
            0,
            start=i * 0.1,
            ttft=0.05 * (i + 1),
            e2e=1.0,
            prompt_tokens=10,
            output_tokens=11,
            itl=[0.095] * 10,
        )
        recs.append(r)
    recs.append(RequestRecord("bad", 0, start=0.0, error="http_503"))
    s = summarize(recs, 2.0, parse_slo("ttft=200"))
    assert s.completed == 10 and s.failed == 1 and s.errors == {"http_503": 1}
    assert s.prompt_tokens == 100 and s.output_tokens == 110
    assert s.request_throughput == pytest.approx(5.0) and s.output_throughput == pytest.approx(55.0)
    assert s.goodput == pytest.approx(4 / 2.0)  # ttft 50, 100, 150, 200 ms meet the SLO
    assert s.ttft_ms["p50"] == pytest.approx(275.0) and s.itl_ms["p99"] == pytest.approx(95.0)
    assert s.tpot_ms["mean"] == pytest.approx(((1.0 - 0.275) / 10) * 1e3, rel=0.2)
    assert s.max_concurrency_seen == 10
    tl = timeline(recs, bucket_s=0.5)
    assert sum(tl["requests_s"]) * 0.5 == pytest.approx(10)
    assert sum(tl["output_tok_s"]) * 0.5 == pytest.approx(110)


def test_workloads_are_seeded_and_sized(src: TextSource) -> None:
    spec = WorkloadSpec(name="random", input_len=64, output_len=8, range_ratio=0.5)
    a, b = _take(sessions(spec, src, 1), 20), _take(sessions(spec, src, 1), 20)
    assert [s.turns[0].user for s in a] == [s.turns[0].user for s in b]
    assert [s.turns[0].user for s in a] != [s.turns[0].user for s in _take(sessions(spec, src, 2), 20)]
    lens = [src.count(s.turns[0].user) for s in a]
    assert all(20 <= n <= 96 for n in lens) and len(set(lens)) > 3
    assert all(4 <= s.turns[0].max_tokens <= 12 for s in a)

    exact = _take(sessions(WorkloadSpec(name="random", input_len=50), src, 0), 10)
    assert all(45 <= src.count(s.turns[0].user) <= 50 for s in exact)


def test_shared_prefix_and_multi_turn_structure(src: TextSource) -> None:
    spec = WorkloadSpec(name="shared-prefix", num_groups=3, system_prompt_len=40, question_len=10)
    got = _take(sessions(spec, src, 0), 60)
    assert {s.group for s in got} == {0, 1, 2}
    by_group = {s.group: s.system for s in got}
    assert all(s.system == by_group[s.group] for s in got) and len(set(by_group.values())) == 3
    assert len({s.turns[0].user for s in got}) > 50

    mt = WorkloadSpec(name="multi-turn", num_groups=2, system_prompt_len=20, question_len=5, num_turns=3)
    first = next(sessions(mt, src, 0))
    assert len(first.turns) == 3 and mt.mean_turns == 3
    msgs = chat_messages(first, [(first.turns[0].user, "an answer")], first.turns[1].user)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    prompt = completion_prompt(first, [(first.turns[0].user, "an answer")], first.turns[1].user)
    assert prompt.startswith(first.system) and "an answer" in prompt


def test_group_skew_makes_low_groups_popular(src: TextSource) -> None:
    spec = WorkloadSpec(
        name="shared-prefix", num_groups=4, system_prompt_len=8, question_len=4, group_skew=1.5
    )
    counts = [0] * 4
    for s in _take(sessions(spec, src, 1), 400):
        counts[s.group] += 1
    # weights 1, 0.35, 0.19, 0.125 of 1.67: group 0 ~60%, group 3 ~7.5%
    assert counts[0] > 180 and counts[3] < 60 and counts == sorted(counts, reverse=True)


def test_group_burst_starts_a_groups_sessions_in_a_row(src: TextSource) -> None:
    spec = WorkloadSpec(
        name="multi-turn", num_groups=6, system_prompt_len=8, question_len=4, num_turns=2, group_burst=4
    )
    groups = [s.group for s in _take(sessions(spec, src, 2), 40)]
    runs = [groups[i:i + 4] for i in range(0, 40, 4)]
    assert all(len(set(r)) == 1 for r in runs) and len({r[0] for r in runs}) > 1
    with pytest.raises(WorkloadError, match="--group-burst"):
        WorkloadSpec(name="multi-turn", group_burst=0).check()


def test_skew_mix(src: TextSource) -> None:
    spec = WorkloadSpec(name="skew", long_fraction=0.25, long_input_len=80, short_input_len=8)
    got = _take(sessions(spec, src, 3), 200)
    longs = [s for s in got if s.kind == "long"]
    assert 30 <= len(longs) <= 70
    assert min(src.count(s.turns[0].user) for s in longs) > 60
    assert max(src.count(s.turns[0].user) for s in got if s.kind == "short") <= 8


def test_file_workload(tmp_path: Path, src: TextSource) -> None:
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 5},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"turns": ["one", "two"], "session_id": "conv"},
    ]
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    got = _take(sessions(WorkloadSpec(name="file", file=str(path), output_len=7), src, 0), 4)
    assert got[0].turns[0].user == "hello there" and got[0].turns[0].max_tokens == 5
    assert got[1].system == "be brief" and got[1].turns[0].max_tokens == 7
    assert got[2].session_id == "conv" and [t.user for t in got[2].turns] == ["one", "two"]
    assert got[3].turns[0].user == "hello there" and got[3].session_id != got[0].session_id
    path.write_text('{"nothing": 1}\n')
    with pytest.raises(WorkloadError, match="line 1"):
        next(sessions(WorkloadSpec(name="file", file=str(path)), src, 0))


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--base-url", "localhost:8000"], "--base-url"),
        (["--base-url", "http://a", "--num-prompts", "0"], "--num-prompts"),
        (["--base-url", "http://a", "--request-rate", "-1"], "--request-rate"),
        (["--base-url", "http://a", "--slo", "ttft"], "--slo"),
        (["--base-url", "http://a", "--workload", "file"], "--workload-file"),
        (["--base-url", "http://a", "--range-ratio", "1.5"], "--range-ratio"),
        (["--base-url", "http://a", "--group-skew", "-1"], "--group-skew"),
        (["--base-url", "http://a", "--duration", "5"], "--max-concurrency"),
        (["--compare", "nourl"], "--compare"),
        (["--base-url", "http://a", "--header", "novalue"], "--header"),
        ([], "--base-url"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv: list[str], flag: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lbd", "bench", *argv], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert flag in proc.stderr


def test_bench_does_not_import_torch(tiny_llama: Path) -> None:
    code = (
        "import sys; from lbd.bench import cli, plot; from lbd.bench.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(tiny_llama)!r}); sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_oracle_hit_rate_counts_full_blocks_in_arrival_order(src: TextSource) -> None:
    from lbd.bench.oracle import block_hashes, oracle_hit_rate, prompt_ids

    tok = src.tok
    system = src.text(random.Random(0), 100)
    first = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    ids = prompt_ids(tok, first)
    answer = " one two three"
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "and again"}]
    ids2 = prompt_ids(tok, second)
    recs = [RequestRecord("a", 0, start=0.0, ttft=0.1, e2e=0.2, prompt_tokens=len(ids), text=answer),
            RequestRecord("b", 0, start=1.0, ttft=0.1, e2e=0.2, prompt_tokens=len(ids2), text="x")]
    recs[0].prompt, recs[1].prompt = first, second
    res = oracle_hit_rate(recs, tok, 16)
    assert res.requests == 2 and res.length_matches == 2 and res.queries == len(ids) + len(ids2)
    # the second request shares every full block of the first one's prompt (and maybe more of the answer)
    shared = 0
    h1, h2 = block_hashes(ids, 16), block_hashes(ids2, 16)
    while shared < min(len(h1), len(h2)) and h1[shared] == h2[shared]:
        shared += 1
    assert shared >= 6 and res.hits >= shared * 16
    assert res.hit_rate == pytest.approx(res.hits / res.queries)
    # the same request twice: the repeat hits all but the block holding its last token
    same = [RequestRecord("c", 0, start=float(i), ttft=0.1, e2e=0.2, text="") for i in range(2)]
    for r in same:
        r.prompt = "plain text prompt " * 20
    plain = prompt_ids(tok, same[0].prompt)
    assert oracle_hit_rate(same, tok, 16).hits == (len(plain) - 1) // 16 * 16
