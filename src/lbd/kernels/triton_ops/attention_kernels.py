"""Paged attention kernels: varlen causal prefill over the cache, split-KV decode, and the split reduction.

Keys are addressed token by token through the block table (token p of a sequence lives in block
``block_tables[seq, p // BLOCK_SIZE]`` at offset ``p % BLOCK_SIZE``), so block ids may be arbitrary and
sequence lengths need not be multiples of the block size. Head dims are padded to a power of two (D_PAD)
and masked. Softmax runs online in fp32 with exp2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lbd.kernels.triton_ops.fp8 import dequantise

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, offs_n, n_mask, kv_head, offs_d, d_mask, stride_b, stride_s,
                  stride_h, scale, out_dtype: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """Rows ``offs_n`` of one sequence's K or V for one kv head: [BLOCK_N, D_PAD] in ``out_dtype``."""
    blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = blk * stride_b + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_s + kv_head * stride_h
    x = tl.load(cache_ptr + row[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8:
        x = dequantise(x, scale, FP8)
    return x.to(out_dtype)


@triton.jit
def _attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One online-softmax step over a key tile; scores in the log2 domain."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    return online_softmax_step(tl.where(s_mask, s, float("-inf")), v, m_i, l_i, acc, DOT_PREC)


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """Fold a key tile's scores ``s`` (log2 domain, -inf where masked) and values ``v`` into the running
    max ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing to attend yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def prefill_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, first_seq,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                   qk_scale, k_scale, v_scale, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, FP8: tl.constexpr, DOT_PREC: tl.constexpr):
    """Grid (query tiles, prefill sequences, query heads). Queries are the last q_len of seq_len tokens."""
    pid_m = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if pid_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    end = tl.minimum(seq_len, prefix + (pid_m + 1) * BLOCK_M)  # causal: later keys are never seen
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = _load_kv_tile(kc_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
                          stride_ch, k_scale, q.dtype, BLOCK_SIZE, FP8)
        v = _load_kv_tile(vc_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
                          stride_ch, v_scale, q.dtype, BLOCK_SIZE, FP8)
        s_mask = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, DOT_PREC)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def decode_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_ptr, lse_ptr, bt_ptr, seq_lens_ptr,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_cb, stride_cs, stride_ch,
                  qk_scale, k_scale, v_scale, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """Grid (decode sequences, kv heads, splits). All GROUP query heads of a kv head share each K/V load.

    Each sequence's keys are divided evenly among the splits at run time, so any NUM_SPLITS is correct
    for any length (a CUDA graph captured at one length replays at another). With one split the result
    goes straight to ``out``; otherwise partial outputs and log-sum-exps go to the reduction.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)
    offs_g = tl.arange(0, G_PAD)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for s in range(start, end, BLOCK_N):
        offs_n = s + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = _load_kv_tile(kc_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
                          stride_ch, k_scale, q.dtype, BLOCK_SIZE, FP8)
        v = _load_kv_tile(vc_ptr, bt_row, offs_n, n_mask, kv_head, offs_d, d_mask, stride_cb, stride_cs,
                          stride_ch, v_scale, q.dtype, BLOCK_SIZE, FP8)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, DOT_PREC)
    finish_split(acc, m_i, l_i, out_ptr + seq.to(tl.int64) * stride_ot + heads * stride_oh, part_ptr, lse_ptr,
                 (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split, g_mask, offs_d,
                 d_mask, D_PAD, NUM_SPLITS)


@triton.jit
def finish_split(acc, m_i, l_i, out_rows, part_ptr, lse_ptr, part_rows, row_mask, offs_d, d_mask,
                 D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """End a split-KV decode program: with one split, store the normalised output at ``out_rows`` (a
    pointer per query head row); else the partial output and its log-sum-exp at ``part_rows`` of
    part [B, H, NUM_SPLITS, D_PAD] / lse [B, H, NUM_SPLITS] (fp32, log2 domain, -inf if empty) for
    ``reduce_splits_kernel``. An empty split (or seq_len 0) gives zeros."""
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_rows[:, None] + offs_d[None, :], out.to(out_rows.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])
    else:
        tl.store(part_ptr + part_rows[:, None] * D_PAD + offs_d[None, :], out, mask=row_mask[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + part_rows, lse, mask=row_mask)


@triton.jit
def reduce_splits_kernel(part_ptr, lse_ptr, out_ptr, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr):
    """Grid (decode sequences, query heads): merge the splits' partial softmaxes by their log-sum-exps."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    offs_s = tl.arange(0, S_PAD)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # zero for empty splits
    offs_d = tl.arange(0, D_PAD)
    part = tl.load(part_ptr + (row * NUM_SPLITS + offs_s)[:, None] * D_PAD + offs_d[None, :],
                   mask=s_mask[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def zero_tail_kernel(out_ptr, qsl_ptr, num_seqs, n_rows, stride_ot, row_elems, BLOCK: tl.constexpr):
    """Zero the padding rows past the batch's last query (their count is only known on the device)."""
    first = tl.load(qsl_ptr + num_seqs)
    offs = tl.arange(0, BLOCK)
    for r in range(first, n_rows):
        for c in range(0, row_elems, BLOCK):
            cols = c + offs
            tl.store(out_ptr + r * stride_ot + cols, tl.zeros([BLOCK], out_ptr.dtype.element_ty),
                     mask=cols < row_elems)
