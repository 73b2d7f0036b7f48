"""C kernels for the CPU hot path (fp32), with the torch references as the fallback.

Why C: decode attention over a paged cache in torch must gather every sequence's blocks into a dense copy
first; in C each row is read in place (``paged_decode.c``). The per-token ops of a layer (RMSNorm with the
residual add, rotary) are a few torch ops each, and at decode batch sizes torch's per-op
dispatch and thread wake-ups cost more than their arithmetic (``elementwise.c``). Linear
projections run over weights packed once at load (``packed_gemm.c``, ``packed.py``). They share a thread pool
that never waits for a descheduled thread (``pool.c``).
How they are built and loaded: ``kernels.cpu.build``.
"""

from __future__ import annotations

import torch

from kernels.cpu.build import library
from kernels.metadata import AttentionMetadata
from kernels.reference import attention as _ref


def _loaded():  # noqa: ANN202 (a ctypes.CDLL)
    lib = library()
    if lib is None:
        raise RuntimeError("kernels.cpu could not be built: check library() before calling its kernels")
    return lib


__all__ = ["library", "bind_threads", "start_pool", "pool_threads", "supports", "paged_decode",
           "paged_attention", "elementwise_ok", "rms_norm", "rotary_neox"]


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


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's contract (fp32 or bf16 caches): decodes in C, prefill chunks through the reference."""
    query_lens, seq_lens = _ref.host_lens(meta)
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        paged_decode(query[:nd], key_cache, value_cache, meta.block_tables, meta.seq_lens, seq_lens[:nd],
                     scale, out)
    _ref.attend_prefills(query, key_cache, value_cache, meta, query_lens, seq_lens, scale, out)
    return out


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
