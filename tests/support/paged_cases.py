"""Random paged-attention batches for the kernel tests and the plain dense oracles to check them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lbd.kernels.metadata import AttentionMetadata


@dataclass(slots=True)
class PagedCase:
    query: torch.Tensor  # [T, H, d]
    keys: list[torch.Tensor]  # per sequence, [S_i, Hkv, d]: every key of the sequence (prefix + new)
    values: list[torch.Tensor]
    key_cache: torch.Tensor  # [NB, BS, Hkv, d], already holding every key
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float


def make_case(lens: list[tuple[int, int]], *, heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None, seed: int = 0,
              extra_blocks: int = 3, pad_tokens: int = 0, k_scale: float = 1.0,
              v_scale: float = 1.0) -> PagedCase:
    """``lens`` = [(query_len, seq_len)] with decodes (query_len 1) first. Blocks are shuffled, unused
    cache slots hold random junk, and ``pad_tokens`` padding queries (slot -1) follow the batch."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    per_seq = [math.ceil(s / block_size) for _, s in lens]
    nb = sum(per_seq) + extra_blocks
    perm = torch.randperm(nb, generator=g)
    width = max(per_seq) + 1
    tables = torch.randint(0, nb, (len(lens), width), generator=g, dtype=torch.int32)  # junk past the end
    junk = torch.randn(nb, block_size, kv_heads, head_dim, generator=g) * 3
    key_cache, value_cache = junk.to(cache_dtype), junk.flip(0).to(cache_dtype)
    keys, values, slots, used = [], [], [], 0
    for i, (_, s) in enumerate(lens):
        ids = perm[used:used + per_seq[i]]
        used += per_seq[i]
        tables[i, : per_seq[i]] = ids.to(torch.int32)
        k = torch.randn(s, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, kv_heads, head_dim, generator=g).to(dtype)
        pos = torch.arange(s)
        seq_slots = ids[pos // block_size].long() * block_size + pos % block_size
        key_cache.view(-1, kv_heads, head_dim)[seq_slots] = (k.float() / k_scale).to(cache_dtype)
        value_cache.view(-1, kv_heads, head_dim)[seq_slots] = (v.float() / v_scale).to(cache_dtype)
        keys.append(k)
        values.append(v)
        slots.append(seq_slots[s - lens[i][0]:])
    qlens = [q for q, _ in lens]
    total = sum(qlens)
    query = torch.randn(total + pad_tokens, heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1, dtype=torch.long)])
    nd = 0
    while nd < len(lens) and lens[nd][0] == 1:
        nd += 1
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor([s for _, s in lens], dtype=torch.int32),
        block_tables=tables, slot_mapping=slot_mapping, max_query_len=max(qlens),
        max_seq_len=max(s for _, s in lens), num_decodes=nd, num_decode_tokens=nd,
        query_lens_cpu=qlens, seq_lens_cpu=[s for _, s in lens])
    return PagedCase(query, keys, values, key_cache, value_cache, meta, 1.0 / math.sqrt(head_dim))


def dense_attention(case: PagedCase) -> torch.Tensor:
    """The simplest causal attention, one sequence at a time, K/V repeated per query head, in fp64."""
    heads = case.query.shape[1]
    outs = []
    start = 0
    for (k, v), n in zip(zip(case.keys, case.values, strict=True), case.meta.query_lens_cpu, strict=True):
        s = k.shape[0]
        q = case.query[start:start + n].double()
        group = heads // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)  # [S, H, d]
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * case.scale
        q_pos = torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
        start += n
    return torch.cat(outs)


def dense_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, logits: torch.Tensor, top_k: int,
              renormalize: bool, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token, expert by expert, in fp64: the definition of a top-k softmax MoE block."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        probs = logits[t].double().softmax(-1)
        top = probs.topk(top_k)
        w = top.values / top.values.sum() if renormalize else top.values
        for weight, e in zip(w.tolist(), top.indices.tolist(), strict=True):
            local = e if expert_map is None else int(expert_map[e])
            if local < 0:
                continue
            gu = w13[local].double() @ hidden[t].double()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += weight * (w2[local].double() @ act)
    return out


@dataclass(slots=True)
class MLACase:
    """A paged MLA batch: per sequence the latents c [S, L] and rope keys k_pe [S, R] (in ``cache`` as
    [NB, BS, L + R] rows), queries split in q_nope [T, H, dn] and rotated q_pe [T, H, R], and kv_b_proj's
    weight [H * (dn + dv), L]."""

    q_nope: torch.Tensor
    q_pe: torch.Tensor
    latents: list[torch.Tensor]
    rope_keys: list[torch.Tensor]
    cache: torch.Tensor
    kv_b: torch.Tensor
    meta: AttentionMetadata
    v_dim: int
    scale: float

    @property
    def lora(self) -> int:
        return self.latents[0].shape[1]

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, L] and W_UV [H, dv, L]."""
        heads, dn = self.q_nope.shape[1], self.q_nope.shape[2]
        w = self.kv_b.view(heads, dn + self.v_dim, self.lora)
        return w[:, :dn], w[:, dn:]


def make_mla_case(lens: list[tuple[int, int]], *, heads: int, lora: int, rope: int, nope: int, v_dim: int,
                  block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> MLACase:
    """``lens`` = [(query_len, seq_len)], decodes first; shuffled blocks, junk in unused slots."""
    base = make_case(lens, heads=1, kv_heads=1, head_dim=lora + rope, block_size=block_size, dtype=dtype,
                     seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    cache = base.key_cache[:, :, 0]  # [NB, BS, L + R], holding base.keys
    latents = [k[:, 0, :lora] for k in base.keys]
    rope_keys = [k[:, 0, lora:] for k in base.keys]
    total = base.query.shape[0]
    q_nope = torch.randn(total, heads, nope, generator=g).to(dtype)
    q_pe = torch.randn(total, heads, rope, generator=g).to(dtype)
    kv_b = (torch.randn(heads * (nope + v_dim), lora, generator=g) / lora**0.5).to(dtype)
    return MLACase(q_nope, q_pe, latents, rope_keys, cache.contiguous(), kv_b, base.meta, v_dim,
                   (nope + rope) ** -0.5)


def dense_mla(case: MLACase) -> torch.Tensor:
    """Keys and values expanded per head, causal attention one sequence at a time, in fp64 -> [T, H, dv]."""
    w_uk, w_uv = (w.double() for w in case.w_uk_uv())
    outs, start = [], 0
    for c, kpe, n in zip(case.latents, case.rope_keys, case.meta.query_lens_cpu, strict=True):
        s = c.shape[0]
        k_nope = torch.einsum("sl,hdl->shd", c.double(), w_uk)
        v = torch.einsum("sl,hdl->shd", c.double(), w_uv)
        q_nope, q_pe = case.q_nope[start:start + n].double(), case.q_pe[start:start + n].double()
        scores = (torch.einsum("qhd,shd->hqs", q_nope, k_nope)
                  + torch.einsum("qhr,sr->hqs", q_pe, kpe.double())) * case.scale
        q_pos = torch.arange(s - n, s)[:, None]
        scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hqs,shd->qhd", scores.softmax(-1), v))
        start += n
    return torch.cat(outs)


def absorbed_query(case: MLACase, rows: slice) -> torch.Tensor:
    """[q_nope W_UK | q_pe] for ``rows``: the decode kernel's input [B, H, L + R]."""
    w_uk, _ = case.w_uk_uv()
    q_lat = torch.einsum("bhd,hdl->bhl", case.q_nope[rows], w_uk)
    return torch.cat([q_lat, case.q_pe[rows]], dim=-1).contiguous()


def dense_grouped_topk(logits: torch.Tensor, top_k: int, groups: int, topk_groups: int,
                       renormalize: bool) -> list[dict[int, float]]:
    """Token by token in fp64: {expert: weight} of DeepSeek's group-limited greedy routing."""
    out = []
    e = logits.shape[1]
    size = e // groups
    for row in logits.double():
        probs = row.softmax(-1)
        best = [max(probs[g * size:(g + 1) * size].tolist()) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -best[g])[:topk_groups]
        cands = sorted((i for g in kept for i in range(g * size, (g + 1) * size)), key=lambda i: -probs[i])
        chosen = {i: float(probs[i]) for i in cands[:top_k]}
        if renormalize:
            total = sum(chosen.values())
            chosen = {i: w / total for i, w in chosen.items()}
        out.append(chosen)
    return out
