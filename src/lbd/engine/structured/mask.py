"""A step's token bitmask: filled by the constrained requests' matchers, applied to the logits in the sampler.

``build`` runs where the matchers live (the core process), over the step's sampling rows in order; a row
without a grammar stays all ones and is not touched by ``apply``. With TP/PP the mask crosses to the sampling
worker (``to_wire``/``from_wire``: only the constrained rows' words travel). ``apply`` sets the logits of
disallowed tokens to -inf with xgrammar's kernel (its CPU kernel, or CUDA/Triton on a GPU), before the
penalties, the sampling and the logprobs, as vLLM does. That kernel is the mask's main cost on a CPU (a few
ms a step at 32 rows: benchmarks/RESULTS.md, "Structured outputs"); ``allows`` lets the sampler skip it for
a greedy row whose unmasked argmax the grammar allows anyway (the masked argmax is then the same token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lbd.engine.structured.backends import Matcher


def words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(slots=True)
class TokenMask:
    rows: list[int]  # the constrained rows of the step's sampling rows
    bitmask: torch.Tensor  # int32 [sampling rows, words(vocab)]; bit set = token allowed
    vocab_size: int

    def to_wire(self) -> tuple[list[int], bytes]:
        return self.rows, self.bitmask[self.rows].numpy().tobytes()

    def allows(self, rows: list[int], token_ids: torch.Tensor) -> list[bool]:
        """Whether each of ``rows`` allows its token of ``token_ids`` (int64 [len(rows)]): its bit is set."""
        ids = token_ids.to("cpu", torch.int64)
        words_ = self.bitmask[torch.tensor(rows, dtype=torch.int64), ids >> 5]
        return ((words_ >> (ids & 31).to(torch.int32)) & 1).bool().tolist()

    @classmethod
    def from_wire(cls, rows: list[int], data: bytes, num_rows: int, vocab_size: int) -> TokenMask:
        bitmask = torch.full((num_rows, words(vocab_size)), -1, dtype=torch.int32)
        sent = torch.frombuffer(bytearray(data), dtype=torch.int32).view(len(rows), -1)
        bitmask[rows] = sent
        return cls(rows, bitmask, vocab_size)


def build(matchers: list[Matcher | None], vocab_size: int) -> TokenMask | None:
    """The mask of one step's sampling rows (``None`` where a row has no grammar; no mask if none has)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bitmask = torch.full((len(matchers), words(vocab_size)), -1, dtype=torch.int32)
    for i in rows:
        matchers[i].fill(bitmask, i)  # type: ignore[union-attr]
    return TokenMask(rows, bitmask, vocab_size)


def apply(logits: torch.Tensor, mask: TokenMask, rows: list[int] | None = None) -> None:
    """Disallowed tokens of the constrained rows (or of ``rows``, some of them) to -inf, in place
    (``logits`` [rows, >= vocab])."""
    import xgrammar

    bitmask = mask.bitmask
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=mask.vocab_size,
                                         indices=mask.rows if rows is None else rows)
