"""Multi-head latent attention (DeepSeek-V2's MLA) over a paged latent cache, in vectorised torch.

The cache holds one row per token: the normalised latent ``c_kv`` (kv_lora_rank = L values) followed by
the rotated shared rope key ``k_pe`` (R values), in blocks [NB, BS, L + R] addressed like the K/V caches
(``AttentionMetadata.block_tables`` / ``slot_mapping``). Keys and values of head h are never stored:
k_h = [W_UK_h c_kv, k_pe] and v_h = W_UV_h c_kv, with W_UK/W_UV the two parts of ``kv_b_proj``.

- Decode uses the weight-absorbed form: the caller folds W_UK into the query (q_lat = q_nope W_UK), so a
  score is q_lat . c_kv + q_pe . k_pe and the output o_lat = sum p c_kv stays in latent space (the caller
  applies W_UV). All heads attend to the same single-"head" latent rows: MQA with head dim L + R whose
  values are the first L columns of the keys.
- Prefill chunks expand the cached latents of their sequence with ``kv_b_proj`` and attend causally in
  ordinary multi-head form (cheaper when many queries share the keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lbd.kernels.metadata import AttentionMetadata
from lbd.kernels.reference.attention import decode_buckets, host_lens


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Store [kv_c (T, L) | k_pe (T, R)] rows in ``cache`` [NB, BS, L + R] at ``slot_mapping`` (-1 = skip)."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.long()
    rows = torch.cat([kv_c[:n], k_pe[:n]], dim=-1).to(cache.dtype)
    if slots.is_cuda or n == 0 or int(slots.min()) < 0:
        keep = slots >= 0
        slots, rows = slots[keep], rows[keep]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, rows)


def _gather_rows(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] as [..., n_blocks * BS, L + R]."""
    g = cache.index_select(0, block_ids.reshape(-1))
    return g.view(*block_ids.shape[:-1], -1, cache.shape[-1])


def _decode_group(query: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_len: int, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """query [B, H, L + R] -> latent output [B, H, L] over each sequence's first seq_lens[b] rows."""
    b = query.shape[0]
    bs = cache.shape[1]
    ids = block_tables[:b, : (max_len + bs - 1) // bs].long()
    rows = _gather_rows(cache, ids).to(query.dtype)  # [B, S, L + R]
    pad = torch.arange(rows.shape[1], device=query.device)[None, :] >= seq_lens[:b, None].long()
    bias = torch.zeros(pad.shape, dtype=query.dtype, device=query.device).masked_fill_(pad, float("-inf"))
    # The H heads are H query rows of one attention "head": [B, 1, H, L + R] over [B, 1, S, L + R].
    out = F.scaled_dot_product_attention(query[:, None], rows[:, None], rows[:, None, :, :kv_lora_rank],
                                         attn_mask=bias[:, None, None, :], scale=scale)[:, 0]
    return out.masked_fill_((seq_lens[:b] == 0)[:, None, None], 0.0)  # no keys (a padding row): zeros


def mla_decode(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Absorbed decode for the batch's first B = query.shape[0] sequences (its decodes).

    query [B, H, L + R] = [q_nope W_UK | rotated q_pe] -> latent output [B, H, L].
    """
    b = query.shape[0]
    _, seq_lens = host_lens(meta)
    out = query.new_empty(b, query.shape[1], kv_lora_rank)
    for rows, max_len in decode_buckets(seq_lens[:b]):
        if rows is None:
            out[:] = _decode_group(query, cache, meta.block_tables, meta.seq_lens, max_len, scale,
                                   kv_lora_rank)
        else:
            idx = torch.tensor(rows, device=query.device)
            out[idx] = _decode_group(query[idx], cache, meta.block_tables[idx], meta.seq_lens[idx], max_len,
                                     scale, kv_lora_rank)
    return out


def mla_prefill(query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, kv_b_weight: torch.Tensor,
                kv_lora_rank: int, v_head_dim: int, scale: float) -> torch.Tensor:
    """Expanded attention for the batch's sequences after its ``num_decodes`` decodes.

    query [T', H, dn + R] holds their queries ([q_nope | rotated q_pe]) in batch order; ``kv_b_weight``
    [H * (dn + dv), L] expands cached latents into per-head k_nope | v. Returns [T', H, dv].
    """
    query_lens, seq_lens = host_lens(meta)
    t, heads, qk_dim = query.shape
    nope = qk_dim - (cache.shape[-1] - kv_lora_rank)
    out = query.new_empty(t, heads, v_head_dim)
    bs = cache.shape[1]
    start = 0
    for i in range(meta.num_decodes, len(seq_lens)):
        n, s = query_lens[i], seq_lens[i]
        if n == 0:
            continue
        ids = meta.block_tables[i, : (s + bs - 1) // bs].long()
        rows = _gather_rows(cache, ids)[:s].to(query.dtype)  # [S, L + R]
        kv = F.linear(rows[:, :kv_lora_rank], kv_b_weight).view(s, heads, nope + v_head_dim)
        k = torch.cat([kv[..., :nope], rows[:, None, kv_lora_rank:].expand(s, heads, -1)], dim=-1)
        v = kv[..., nope:]
        out[start:start + n] = _causal(query[start:start + n], k, v, scale)
        start += n
    if start < t:
        out[start:].zero_()
    return out


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d] are the last n of S positions; k [S, H, d], v [S, H, dv] -> [n, H, dv]."""
    n, s = q.shape[0], k.shape[0]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == s:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        pos = torch.arange(s - n, s, device=q.device)
        hidden = torch.arange(s, device=q.device)[None, :] > pos[:, None]
        bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale)
    return out[0].transpose(0, 1)
