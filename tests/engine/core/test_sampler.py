"""The sampler on hand-made logits: greedy, filters, sampling frequencies, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from lbd.engine.core.sampler import Sampler, SampleRow
from lbd.wire.core_messages import SamplingParams

V = 50


def _rows(params: list[SamplingParams], prompts: list[list[int]] | None = None,
          outputs: list[list[int]] | None = None) -> list[SampleRow]:
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    return [SampleRow(f"r{i}", p, prompts[i], outputs[i]) for i, p in enumerate(params)]


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_exact_argmax() -> None:
    logits = _logits(64)
    logits[5, 7] = logits[5, 9] = 100.0  # a tie: argmax takes the first, as torch does
    ids, lps = Sampler(torch.device("cpu"))(logits, _rows([SamplingParams(temperature=0.0)] * 64))
    assert ids == logits.argmax(-1).tolist()
    assert ids[5] == 7
    assert lps == [None] * 64


def test_filters_that_leave_one_token_equal_greedy() -> None:
    logits = _logits(8, seed=1)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=0.7, min_p=0.999999), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1e-3), SamplingParams(temperature=2.0, top_k=1, top_p=0.5),
              SamplingParams(temperature=1.0, top_k=-1, top_p=1e-6), SamplingParams(temperature=0.0, top_k=5)]
    sampler = Sampler(torch.device("cpu"))
    for _ in range(5):
        ids, _ = sampler(logits, _rows(params))
        assert ids == best


def _frequencies(ids: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(ids), minlength=V).float() / len(ids)


def test_sampling_frequencies_follow_the_filtered_distribution() -> None:
    n = 20000
    base = torch.linspace(2.0, -3.0, V)
    logits = base.repeat(n, 1)
    sampler = Sampler(torch.device("cpu"), seed=3)
    probs = torch.softmax(base / 0.8, -1)
    cases = {
        "temperature": (SamplingParams(temperature=0.8), probs),
        "top_k": (SamplingParams(temperature=0.8, top_k=3), _renorm(probs, probs >= probs[2])),
        # top_p 0.3: keep tokens while the mass before them is below 0.3
        "top_p": (SamplingParams(temperature=0.8, top_p=0.3),
                  _renorm(probs, (probs.cumsum(0) - probs) < 0.3)),
        "min_p": (SamplingParams(temperature=0.8, min_p=0.5), _renorm(probs, probs >= 0.5 * probs[0])),
    }
    for name, (p, expected) in cases.items():
        ids, _ = sampler(logits, _rows([p] * n))
        freq = _frequencies(ids)
        assert freq[expected == 0].sum() == 0, name
        # binomial std at most sqrt(0.25 / n) = 0.0035; allow 5 sigma
        assert (freq - expected).abs().max() < 0.018, (name, freq[:6], expected[:6])


def _renorm(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = probs * keep
    return kept / kept.sum()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _logits(6, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def run(order: list[int], extra: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), seed=extra)
        rows = [SampleRow(f"s{i}", seeded, [], []) for i in order]
        rows += [SampleRow(f"x{j}", other, [], []) for j in range(extra)]
        lg = torch.cat([logits[order], _logits(extra, seed=9)])
        out = []
        for _ in range(5):  # successive steps draw from each request's own generator
            ids, _ = sampler(lg, rows)
            out.append(ids[: len(order)])
        return [[step[order.index(i)] for step in out] for i in range(6)]

    alone = run([0, 1, 2, 3, 4, 5], 0)
    assert run([5, 3, 1, 0, 2, 4], 7) == alone
    assert run([2, 0, 4, 1, 5, 3], 2) == alone
    # a different seed gives a different stream (6 rows x 5 steps over 50 tokens: a collision is ~impossible)
    sampler = Sampler(torch.device("cpu"))
    rows = [SampleRow(f"s{i}", SamplingParams(temperature=1.0, seed=99), [], []) for i in range(6)]
    other_seed = [sampler(logits, rows)[0] for _ in range(5)]
    assert [[step[i] for step in other_seed] for i in range(6)] != alone


def test_finished_requests_drop_their_generator() -> None:
    logits = _logits(1, seed=5)
    sampler = Sampler(torch.device("cpu"))
    rows = _rows([SamplingParams(temperature=1.0, seed=7)])
    first = [sampler(logits, rows)[0][0] for _ in range(8)]
    again = [sampler(logits, rows)[0][0] for _ in range(8)]
    sampler.drop(["r0"])
    restarted = [sampler(logits, rows)[0][0] for _ in range(8)]
    assert restarted == first
    assert again != first  # the generator advanced while the request lived


def _penalised_reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                         out: list[int]) -> torch.Tensor:
    """vLLM's semantics, written token by token."""
    x = logits.clone()
    for t in set(prompt) | set(out):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def test_penalties_match_vllm_semantics() -> None:
    logits = _logits(4, seed=6)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.0, frequency_penalty=0.9),
              SamplingParams(temperature=0.0, presence_penalty=1.3, repetition_penalty=0.6),
              SamplingParams(temperature=0.0)]
    prompts = [[1, 2, 3, 3], [4, 5], [6, 7, 8], [9]]
    outputs = [[3, 10, 10], [5, 5, 5, 11], [8, 12], [13]]
    sampler = Sampler(torch.device("cpu"))
    processed = sampler._penalise(logits.clone(), _rows(params, prompts, outputs))
    for i, p in enumerate(params):
        expected = _penalised_reference(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(processed[i], expected)
    # and greedy picks the argmax of the penalised logits: make a repeated token the raw favourite
    logits[1, 5] = logits[1].max() + 1.0
    ids, _ = sampler(logits, _rows(params, prompts, outputs))
    assert ids[1] != 5
    assert ids[3] == logits[3].argmax().item()


def test_logprobs_are_raw_top_k_plus_the_chosen_token() -> None:
    logits = _logits(3, seed=8)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.5, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=None, repetition_penalty=2.0)]
    ids, lps = Sampler(torch.device("cpu"))(logits, _rows(params, [[0], [0], [0]], [[1], [1], [1]]))
    raw = torch.log_softmax(logits, -1)
    top = raw[0].topk(5)
    assert lps[0].top_ids == top.indices.tolist()
    assert lps[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert lps[0].token_logprob == pytest.approx(raw[0, ids[0]].item(), abs=1e-6)
    assert lps[1].top_ids == [] and lps[1].token_logprob == pytest.approx(raw[1, ids[1]].item(), abs=1e-6)
    assert lps[2] is None
    assert all(math.isfinite(lp.token_logprob) for lp in lps[:2])


@pytest.mark.parametrize("slope", [16.0, 1.0])  # a peaked row (nucleus among 256 candidates), a flat one
def test_top_p_over_a_large_vocabulary(slope: float) -> None:
    vocab, n = 1000, 20000
    base = torch.linspace(slope / 2, -slope / 2, vocab)
    probs = torch.softmax(base, -1)
    nucleus = (probs.cumsum(0) - probs) < 0.6
    assert (nucleus.sum() < 256) == (slope > 8)  # both the candidate path and the full-sort fallback run
    ids, _ = Sampler(torch.device("cpu"), seed=5)(base.repeat(n, 1), _rows([SamplingParams(top_p=0.6)] * n))
    freq = torch.bincount(torch.tensor(ids), minlength=vocab).float() / n
    assert freq[~nucleus].sum() == 0
    expected = _renorm(probs, nucleus)
    # compare cumulative distributions (per-token counts are too small for a flat row)
    assert (freq.cumsum(0) - expected.cumsum(0)).abs().max() < 0.02
