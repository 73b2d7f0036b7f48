"""The sampler's mask on a batch of greedy rows: the argmax it takes (skipping the kernel for rows whose
unmasked argmax is allowed) is the argmax of the fully masked logits, row by row, with unconstrained rows,
permissive rows and rows that refuse their unmasked argmax in one batch, and batches where most refuse."""

from __future__ import annotations

import torch

from lbd.engine.core.sampler import Sampler, SampleRow
from lbd.engine.structured import mask as token_mask
from lbd.wire.core_messages import SamplingParams

VOCAB = 1000


def _mask(num_rows: int, rows: list[int], gen: torch.Generator, strict: bool) -> token_mask.TokenMask:
    bitmask = torch.full((num_rows, token_mask.words(VOCAB)), -1, dtype=torch.int32)
    for i in rows:
        if strict or i % 3 == 0:  # 5 allowed tokens: the unmasked argmax is (nearly) always refused
            bitmask[i] = 0
            for t in torch.randint(0, VOCAB, (5,), generator=gen).tolist():
                bitmask[i, t >> 5] |= torch.tensor(1 << (t & 31), dtype=torch.int64).to(torch.int32)
        elif i % 3 == 1:  # about half the vocabulary
            bitmask[i] = torch.randint(-(2**31), 2**31 - 1, (bitmask.shape[1],), generator=gen,
                                       dtype=torch.int64).to(torch.int32)
    return token_mask.TokenMask(rows, bitmask, VOCAB)


def test_greedy_rows_take_the_argmax_of_the_masked_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"))
    refused = kept = 0
    for trial in range(20):
        n = 12
        rows = [SampleRow(f"r{i}", SamplingParams(temperature=0.0), [1], []) for i in range(n)]
        constrained = [i for i in range(n) if (i + trial) % 4 != 0]
        mask = _mask(n, constrained, gen, strict=trial >= 15)  # then most rows refuse: one full argmax
        logits = torch.randn(n, VOCAB, generator=gen)
        expect = logits.clone()
        token_mask.apply(expect, mask)
        want = expect.argmax(dim=-1).tolist()
        unmasked = logits.argmax(dim=-1)
        ok = mask.allows(constrained, unmasked[constrained])
        refused += ok.count(False)
        kept += ok.count(True)
        got, logprobs = sampler(logits, rows, mask)
        assert got == want, trial
        assert logprobs == [None] * n
        assert all(mask.allows(constrained, torch.tensor([got[i] for i in constrained])))
    assert refused > 20 and kept > 20, (refused, kept)  # both ways were taken
