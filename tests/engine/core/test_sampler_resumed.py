"""A stream resumed on another rank carries its output in the prompt (``prior_output_tokens``): the penalties
must see the same logits as on the unbroken run, where those tokens were output."""

from __future__ import annotations

import torch

from lbd.engine.core.sampler import Sampler, SampleRow
from lbd.engine.server.fields import Fields
from lbd.engine.server.openai_protocol import sampling_from
from lbd.wire.core_messages import SamplingParams

V = 40


def test_prior_output_in_the_prompt_is_penalised_as_output() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 3
    prompt, sent, after = [1, 2, 3, 3], [3, 5, 5, 9], [5, 11]
    kinds = [dict(frequency_penalty=1.0), dict(presence_penalty=0.7, repetition_penalty=1.3),
             dict(frequency_penalty=-0.4, presence_penalty=0.2)]
    unbroken = [SampleRow(f"u{i}", SamplingParams(temperature=0.0, **k), prompt, sent + after)
                for i, k in enumerate(kinds)]
    resumed = [SampleRow(f"r{i}", SamplingParams(temperature=0.0, prior_output_tokens=len(sent), **k),
                         prompt + sent, after) for i, k in enumerate(kinds)]
    sampler = Sampler(torch.device("cpu"))
    want = sampler._penalise(logits.clone(), unbroken)
    torch.testing.assert_close(sampler._penalise(logits.clone(), resumed), want)
    # without the field the sent tokens are prompt tokens: the frequency and presence penalties differ
    plain = [SampleRow(r.request_id + "p", SamplingParams(temperature=0.0, **k), r.prompt_ids, r.output_ids)
             for r, k in zip(resumed, kinds, strict=True)]
    assert not torch.allclose(sampler._penalise(logits.clone(), plain), want)


def test_more_prior_output_than_prompt_is_clamped() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, prior_output_tokens=99)
    row = SampleRow("r", params, [4], [])
    out = Sampler(torch.device("cpu"))._penalise(torch.zeros(1, V), [row])
    assert out[0, 4].item() == -1.0 and out[0].sum().item() == -1.0


def test_the_engine_reads_the_routers_field() -> None:
    assert sampling_from(Fields({"lbd_resumed_output_tokens": 7})).prior_output_tokens == 7
    assert sampling_from(Fields({})).prior_output_tokens == 0
