"""C kernels for the CPU hot path (fp32), with the torch references as the fallback.

Why C: decode attention over a paged cache in torch must gather every sequence's blocks into a dense copy
first; in C each row is read in place (``paged_decode.c``). The per-token ops of a layer (RMSNorm with the
residual add, rotary, SiLU-and-mul) are a few torch ops each, and at decode batch sizes torch's per-op
dispatch and thread wake-ups cost more than their arithmetic (``elementwise.c``). Linear
projections run over weights packed once at load (``packed_gemm.c``, ``packed.py``), on huge pages
(``pages.py``). A plain fp32 Llama stack chains all of them in one call per step (``decoder.c``,
``decoder.py``). They share a thread pool that never waits for a descheduled thread (``pool.c``).
How they are built and loaded: ``lbd.kernels.cpu.build``.
"""

from __future__ import annotations

import torch

from lbd.kernels.cpu.build import library
from lbd.kernels.metadata import AttentionMetadata
from lbd.kernels.reference import attention as _ref


def _loaded():  # noqa: ANN202 (a ctypes.CDLL)
    lib = library()
    if lib is None:
        raise RuntimeError("lbd.kernels.cpu could not be built: check library() before calling its kernels")
    return lib


__all__ = ["library", "bind_threads", "start_pool", "pool_threads", "supports", "paged_decode",
           "paged_attention", "elementwise_ok", "rms_norm", "rotary_neox", "silu_and_mul", "argmax",
           "write_ok", "write_kv_cache",
           "PREFILL_IN_C_MAX_LEN"]


def _cpu_array(cpus: list[int]):  # noqa: ANN202 (a ctypes array)
    import ctypes

    return (ctypes.c_int * len(cpus))(*cpus)


def start_pool(cpus: list[int]) -> bool:
    """Run the C kernels on the calling thread plus len(cpus) - 1 helpers pinned to cpus[1:], instead of
    torch's OpenMP threads (kernels/cpu/pool.c says why); cpus[0] is meant for the caller, which may pin
    itself. Once per process; False if the kernels are not built or the pool could not start."""
    lib = library()
    return lib is not None and bool(cpus) and lib.lbd_pool_start(_cpu_array(cpus), len(cpus)) == 0


def pool_threads() -> int:
    """Threads of the kernels' pool (0: not started, the kernels use torch's OpenMP threads)."""
    lib = library()
    return 0 if lib is None else int(lib.lbd_pool_threads())


def bind_threads(cpus: list[int]) -> bool:
    """Pin torch's OpenMP threads one per CPU of ``cpus`` (thread t -> cpus[t % len]); False when the kernels
    are not built or the kernel refused. Call after ``torch.set_num_threads``."""
    lib = library()
    return lib is not None and bool(cpus) and lib.lbd_bind_threads(_cpu_array(cpus), len(cpus)) == 0


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C decode attention takes these (fp32 or bf16 CPU, query and cache alike, dense heads), and
    the kernels loaded."""
    return (query.dtype in (torch.float32, torch.bfloat16) and key_cache.dtype == query.dtype
            and not query.is_cuda and query.stride(-1) == 1 and query.stride(-2) == query.shape[-1]
            and key_cache.is_contiguous() and library() is not None)


def write_ok(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``write_kv_cache`` takes these: rows of the caches' own dtype (no fp8 scaling), each token's
    [Hkv, d] dense, contiguous caches, the kernels loaded."""
    return (key.dtype == key_cache.dtype == value.dtype and key.dtype in (torch.float32, torch.bfloat16)
            and not key.is_cuda and key_cache.is_contiguous() and key.dim() == 3
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and library() is not None)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """The reference's contract for ``write_ok`` inputs: key/value [T, Hkv, d] to caches [NB, BS, Hkv, d] at
    ``slot_mapping`` (-1 = skip), one pass on the kernels' pool."""
    n = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64).contiguous()
    elem = key.element_size()
    _loaded().lbd_write_kv(key.data_ptr(), key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem,
                           key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(), n,
                           key.shape[1] * key.shape[2] * elem)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], scale: float,
                 out: torch.Tensor) -> None:
    """out[b] = attention of query[b] ([B, H, d]) over sequence b's first ``lens[b]`` cached tokens."""
    lib = _loaded()
    b, h, d = query.shape
    _, bs, hkv, _ = key_cache.shape
    tables = block_tables[:b].to(torch.int32).contiguous()
    lens_t = seq_lens[:b].to(torch.int32).contiguous()
    fn = lib.lbd_paged_decode_bf16 if query.dtype == torch.bfloat16 else lib.lbd_paged_decode_f32
    code = fn(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens_t.data_ptr(), out.data_ptr(), out.stride(0), h, hkv, d, bs, scale, b,
        max(lens, default=0))
    if code:
        raise MemoryError("CPU decode attention could not allocate its score buffer")


# Prefill sequences up to this long run in C as one decode per query token (its causal prefix is its
# context); longer ones go to torch's flash SDPA. Measured interleaved on a loaded 2-core host: 4 prompts of
# 125 tokens 3.2-5.9 ms in C vs 7.9-10.9 ms in SDPA per layer; one of 512 on par (19-30 vs 19-55 ms). SDPA
# runs on torch's one thread beside the kernels' pool, and its tiles win back the pool's second thread only
# on long rows.
PREFILL_IN_C_MAX_LEN = 512


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's contract (fp32 or bf16 caches): decodes in C; prefill chunks of short sequences in C
    too (``PREFILL_IN_C_MAX_LEN``), longer ones through the reference."""
    query_lens, seq_lens = _ref.host_lens(meta)
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        paged_decode(query[:nd], key_cache, value_cache, meta.block_tables, meta.seq_lens, seq_lens[:nd],
                     scale, out)
    short = _short_prefills(query, key_cache, value_cache, meta, query_lens, seq_lens, scale, out)
    if len(short) < len(seq_lens) - nd:
        _ref.attend_prefills(query, key_cache, value_cache, meta, query_lens, seq_lens, scale, out,
                             skip=short)
    elif sum(query_lens) < query.shape[0]:
        out[sum(query_lens):].zero_()  # padding rows, as the reference leaves them
    return out


def _short_prefills(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, query_lens: list[int], seq_lens: list[int], scale: float,
                    out: torch.Tensor) -> set[int]:
    """Attend the prefill sequences of at most PREFILL_IN_C_MAX_LEN tokens as decodes: query token j of a
    chunk of n ending at seq_len sees the first seq_len - n + j + 1 tokens. Returns those sequences."""
    nd = meta.num_decodes
    short = {i for i in range(nd, len(seq_lens))
             if 0 < query_lens[i] and seq_lens[i] <= PREFILL_IN_C_MAX_LEN}
    if not short:
        return short
    rows: list[int] = []  # flat token rows, the table row of each, and each one's context length
    table_rows: list[int] = []
    lens: list[int] = []
    start = nd
    for i in range(nd, len(seq_lens)):
        n = query_lens[i]
        if i in short:
            first = seq_lens[i] - n + 1
            rows.extend(range(start, start + n))
            table_rows.extend([i] * n)
            lens.extend(range(first, first + n))
        start += n
    dev = query.device
    tables = meta.block_tables.index_select(0, torch.tensor(table_rows, device=dev))
    lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
    if rows[-1] - rows[0] + 1 == len(rows):  # one run of rows (the usual case): in place
        a, b = rows[0], rows[-1] + 1
        paged_decode(query[a:b], key_cache, value_cache, tables, lens_t, lens, scale, out[a:b])
        return short
    rows_t = torch.tensor(rows, device=dev)
    part = torch.empty((len(rows), *query.shape[1:]), dtype=query.dtype, device=dev)
    paged_decode(query.index_select(0, rows_t), key_cache, value_cache, tables, lens_t, lens, scale, part)
    out.index_copy_(0, rows_t, part)
    return short


def elementwise_ok(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors whose rows are dense (any row stride), and the kernels loaded."""
    return all(t.dtype == torch.float32 and not t.is_cuda and t.dim() == 2 and t.stride(1) == 1
               for t in tensors) and library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference's contract for x [T, D]: norm(x), or (norm(x + residual), x + residual)."""
    t, d = x.shape
    out = torch.empty((t, d), dtype=x.dtype)
    lib = _loaded()
    if residual is None:
        lib.lbd_rms_norm_f32(x.data_ptr(), x.stride(0), None, None, weight.data_ptr(), out.data_ptr(), t, d,
                             eps)
        return out
    residual = residual.contiguous()
    new_residual = torch.empty((t, d), dtype=x.dtype)
    lib.lbd_rms_norm_f32(x.data_ptr(), x.stride(0), residual.data_ptr(), new_residual.data_ptr(),
                         weight.data_ptr(), out.data_ptr(), t, d, eps)
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """The reference's contract: x [T, 2I] -> silu(x[:, :I]) * x[:, I:] (fp32, rows dense)."""
    t, two_i = x.shape
    out = torch.empty((t, two_i // 2), dtype=x.dtype)
    _loaded().lbd_silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), t, two_i // 2)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [T, V] (fp32, rows dense, V >= 1): int64 [T], the first index on ties, a
    NaN counting as the largest."""
    t, v = x.shape
    out = torch.empty(t, dtype=torch.int64)
    if t:
        _loaded().lbd_argmax_f32(x.data_ptr(), x.stride(0), t, v, out.data_ptr())
    return out


def rotary_neox(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
                head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*d] and k [T, Hk*d] in place (neox layout) by ``cos_sin[positions]``."""
    pos = positions.reshape(-1).to(torch.int64).contiguous()
    table = cos_sin.contiguous()
    lib = _loaded()
    lib.lbd_rotary_neox_f32(pos.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                            table.data_ptr(), pos.numel(), q.shape[1] // head_dim, k.shape[1] // head_dim,
                            head_dim, table.shape[1])
    return q, k
