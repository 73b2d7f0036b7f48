"""Turn a step's logits into tokens, vectorised over the batch.

Order as in vLLM: a structured-output row's token mask (its grammar's allowed tokens, lbd.engine.structured),
penalties on the logits, then greedy rows take the argmax; the others divide by their temperature, drop tokens
under min_p, keep top_k / top_p, and sample by inverse CDF: one uniform number per row and step (the CPU draws
the V exponentials of the exponential race far slower: benchmarks/RESULTS.md, "Sampling draws"). A request
with a seed draws its number from its own generator, so its output does not depend on the rest of the batch.
Logprobs are of the model distribution before any processing but the mask (log-softmax of the masked
logits), like vLLM's default. Frequency and presence penalties count the output, and the prompt's last
``prior_output_tokens`` with it: the output a stream had before it moved here from another rank (lbd.router).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from lbd.engine.structured import mask as token_mask
from lbd.kernels import ops
from lbd.wire.core_messages import SamplingParams, TokenLogprobs


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one sampling sequence."""

    request_id: str
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]


def _needs_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _output_counts(row: SampleRow) -> Counter[int]:
    """The answer's tokens so far: its output, and the prompt's last ``prior_output_tokens`` (the output a
    resumed stream had before it moved here), so the penalties count what an unbroken run counts."""
    counts = Counter(row.output_ids)
    prior = min(row.params.prior_output_tokens, len(row.prompt_ids))
    if prior > 0:
        counts.update(row.prompt_ids[len(row.prompt_ids) - prior :])
    return counts


def _plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that reads the processed logits but the argmax (no penalties, no logprobs)."""
    return p.greedy and p.logprobs is None and not _needs_penalties(p)


def _masked_argmax(logits: torch.Tensor, mask: token_mask.TokenMask) -> torch.Tensor:
    """The argmax of every row under ``mask``, for a batch of plain greedy rows: a constrained row whose
    unmasked argmax its grammar allows keeps it (the masked argmax is the same token, ties included: the
    first index wins either way); only the others go through the mask's kernel and a second argmax. Most
    rows of a model that follows its format take the first way, and the kernel is the mask's main cost."""
    ids = ops.argmax(logits)
    allowed = mask.allows(mask.rows, ids[mask.rows])
    refused = [r for r, ok in zip(mask.rows, allowed, strict=True) if not ok]
    if refused:
        token_mask.apply(logits, mask, refused)
        if 2 * len(refused) > len(ids):  # most rows: one argmax over the batch beats copying them out
            return ops.argmax(logits)
        idx = torch.tensor(refused, device=logits.device)
        ids[idx] = ops.argmax(logits[idx])
    return ids


def _top_k(p: SamplingParams) -> int:
    return p.top_k if p.top_k > 0 else 0


TOP_P_CANDIDATES = 256  # sorted candidates tried first for top-p (most nuclei of a language model fit)


def _top_k_top_p(probs: torch.Tensor, params: list[SamplingParams], candidates: int) -> torch.Tensor:
    """Zero the probabilities outside each row's top_k, then outside its top_p nucleus (of the top-k mass).

    A full sort of the vocabulary is slow on CPU (benchmarks/RESULTS.md, "Top-p sort"), so only the largest
    ``candidates`` probabilities are sorted (topk); that is exact whenever every nucleus ends inside them,
    which is checked, else the whole row set is redone with a full sort. The kept set becomes a threshold on
    the probability.
    """
    vocab = probs.shape[1]
    dev = probs.device
    max_k = max((_top_k(p) for p in params), default=0)
    want_p = any(p.top_p < 1.0 for p in params)
    k0 = min(vocab, max(max_k, candidates if want_p else 1))
    vals = probs.topk(k0, dim=-1).values if k0 < vocab else probs.sort(dim=-1, descending=True).values
    ks = [min(_top_k(p) or vocab, k0) for p in params]
    has_k = torch.tensor([0 < _top_k(p) < vocab for p in params], device=dev)
    pos = torch.arange(k0, device=dev)[None, :]
    keep = pos < torch.tensor(ks, device=dev)[:, None]
    if want_p:
        vals_k = vals * keep
        total = torch.where(has_k, vals_k.sum(dim=-1), probs.sum(dim=-1))
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        cum = vals_k.cumsum(dim=-1)
        covered = has_k | (cum[:, -1] >= top_p * total) | (top_p >= 1.0)
        if k0 < vocab and not bool(covered.all()):
            return _top_k_top_p(probs, params, vocab)
        keep &= (cum - vals_k) < (top_p * total)[:, None]  # keep while the mass before is below top_p
    filtered = has_k | torch.tensor([p.top_p < 1.0 for p in params], device=dev)
    smallest = vals.gather(1, (keep.sum(dim=-1) - 1).clamp_(min=0)[:, None])
    threshold = torch.where(filtered[:, None], smallest, torch.zeros_like(smallest))
    return probs.masked_fill(probs < threshold, 0.0)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.default_gen = torch.Generator(device=device)
        self.default_gen.manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, until they finish
        self.prompt_sets: dict[str, set[int]] = {}  # prompt tokens of requests with a repetition penalty

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.prompt_sets.pop(rid, None)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], mask: token_mask.TokenMask | None = None
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [N, V] (any float dtype) -> N token ids and, where asked, their logprobs. ``mask``: the
        structured-output rows' allowed tokens (lbd.engine.structured.mask), applied first, as vLLM does (the
        logprobs of a constrained row are those of its masked logits)."""
        logits = logits.float()
        params = [r.params for r in rows]
        if mask is not None and all(_plain_greedy(p) for p in params):
            ids = _masked_argmax(logits, mask)
            return ids.tolist(), [None] * len(params)
        if mask is not None:
            token_mask.apply(logits, mask)
        processed = self._penalise(logits, rows) if any(_needs_penalties(p) for p in params) else logits
        if all(p.greedy for p in params):
            ids = ops.argmax(processed)
        else:
            ids = self._random(processed, rows)
        token_ids: list[int] = ids.tolist()
        return token_ids, self._logprobs(logits, ids, params)

    # ------------------------------------------------------------------------------------------ processing

    def _penalise(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Penalties touch only the tokens a row has seen: gather/scatter at those ids, never a full [N, V]
        pass per penalty (each of which costs about a millisecond on the CPU)."""
        out = logits.clone()
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            seen = [sorted(self._prompt_set(rows[i]).union(rows[i].output_ids)) for i in rep]
            row_idx, tok_idx = self._index(rep, seen, pad_with_first=True)
            vals = out[row_idx, tok_idx]
            pen = torch.tensor([rows[i].params.repetition_penalty for i in rep], device=out.device)[:, None]
            out[row_idx, tok_idx] = torch.where(vals > 0, vals / pen, vals * pen)
        fp = [i for i, r in enumerate(rows) if r.params.frequency_penalty or r.params.presence_penalty]
        if fp:
            counts = [_output_counts(rows[i]) for i in fp]
            amounts = [[rows[i].params.frequency_penalty * c + rows[i].params.presence_penalty
                        for c in cnt.values()] for i, cnt in zip(fp, counts, strict=True)]
            row_idx, tok_idx = self._index(fp, [list(c) for c in counts], pad_with_first=False)
            width = tok_idx.shape[1]
            src = torch.tensor([a + [0.0] * (width - len(a)) for a in amounts], device=out.device)
            out.index_put_((row_idx.expand_as(tok_idx), tok_idx), -src, accumulate=True)
        return out

    def _index(self, rows: list[int], ids: list[list[int]],
               pad_with_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index [R, 1], padded token ids [R, W]) for advanced indexing; padding repeats a row's first
        id (harmless for an assignment) or uses id 0 (paired with a zero amount for an accumulation)."""
        width = max(1, max(len(t) for t in ids))
        padded = [t + [t[0] if (pad_with_first and t) else 0] * (width - len(t)) for t in ids]
        row_idx = torch.tensor(rows, device=self.device)[:, None]
        return row_idx, torch.tensor(padded, device=self.device)

    def _prompt_set(self, row: SampleRow) -> set[int]:
        cached = self.prompt_sets.get(row.request_id)
        if cached is None:
            cached = self.prompt_sets[row.request_id] = set(row.prompt_ids)
        return cached

    def _random(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        dev = logits.device
        greedy = [p.greedy for p in params]
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                             device=dev)
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            probs = probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, 0.0)
        if any(_top_k(p) or p.top_p < 1.0 for p in params):
            probs = _top_k_top_p(probs, params, min(probs.shape[1], TOP_P_CANDIDATES))
        # inverse CDF: one uniform number per row and step; zero-probability tokens have empty intervals
        cdf = probs.cumsum(dim=-1)
        target = self._uniform(rows) * cdf[:, -1]
        choice = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
        choice.clamp_(max=probs.shape[1] - 1)  # a rounding hair past the last cdf value
        if any(greedy):
            mask = torch.tensor(greedy, device=dev)
            choice = torch.where(mask, ops.argmax(logits), choice)
        return choice

    def _uniform(self, rows: list[SampleRow]) -> torch.Tensor:
        u = torch.rand(len(rows), device=self.device, generator=self.default_gen)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                u[i] = torch.rand(1, device=self.device, generator=self._generator(row))[0]
        return u

    def _generator(self, row: SampleRow) -> torch.Generator:
        gen = self.generators.get(row.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(int(row.params.seed))
            self.generators[row.request_id] = gen
        return gen

    # ------------------------------------------------------------------------------------------- logprobs

    @staticmethod
    def _logprobs(logits: torch.Tensor, ids: torch.Tensor,
                  params: list[SamplingParams]) -> list[TokenLogprobs | None]:
        wanted = [p.logprobs is not None for p in params]
        if not any(wanted):
            return [None] * len(params)
        lp = torch.log_softmax(logits, dim=-1)
        chosen: list[float] = lp.gather(1, ids[:, None]).squeeze(1).tolist()
        k = max(p.logprobs or 0 for p in params)
        top_vals: list[list[float]] = [[] for _ in params]
        top_ids: list[list[int]] = [[] for _ in params]
        if k > 0:
            vals, tids = lp.topk(min(k, lp.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), tids.tolist()
        out: list[TokenLogprobs | None] = []
        for i, p in enumerate(params):
            if not wanted[i]:
                out.append(None)
                continue
            n = p.logprobs or 0
            out.append(TokenLogprobs(chosen[i], top_ids[i][:n], top_vals[i][:n]))
        return out
