"""C kernels for the CPU hot path, built with the system C compiler at first use and loaded with ctypes.

Why C and not torch: decode attention over a paged cache in torch must gather every sequence's blocks into a
dense copy first; in C each row is read in place (see ``paged_decode.c``). Why ctypes and not a torch
extension: a plain C file with no torch headers compiles in well under a second, so the engine can build it
at start-up on any machine with ``cc``; the ``.so`` is cached per source, flags and CPU under
``$LBD_CACHE_DIR/kernels`` (default ``~/.cache/lbd/kernels``). Without a compiler, or when the build fails,
``library()`` returns None and callers keep the torch reference (logged once).

Threads: the kernel is OpenMP; its ``libgomp.so.1`` resolves to the copy torch has loaded, so it shares
torch's thread pool and ``torch.set_num_threads``. (A Python thread pool splitting the batch, tried first,
lost ~0.8 ms per layer waiting for its worker while torch's OpenMP threads spun on the same cores.)
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.metadata import AttentionMetadata
from kernels.reference import attention as _ref

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("paged_decode.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("LBD_CACHE_DIR") or str(Path.home() / ".cache" / "lbd")
    return Path(root) / "kernels"


def _cpu_key() -> bytes:
    """The CPU's feature flags: a .so built with -march=native must not run on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return os.uname().machine.encode()


def _build(cc: str) -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + _cpu_key()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(tmp, target)  # atomic: ranks building at once all end with one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, build failed, or LBD_CPU_KERNELS=0)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("LBD_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler (cc/gcc) found: CPU decode attention uses the slower torch reference")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the CPU kernels failed (%s %s): using the torch reference", e,
                       detail.decode(errors="replace")[-500:])
        return None
    fn = lib.lbd_paged_decode_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64,
                   _I64]
    _lib = lib
    return lib


def supports(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return (query.dtype == torch.float32 and key_cache.dtype == torch.float32 and not query.is_cuda
            and query.stride(-1) == 1 and query.stride(-2) == query.shape[-1] and key_cache.is_contiguous())


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int], scale: float,
                 out: torch.Tensor) -> None:
    """out[b] = attention of query[b] ([B, H, d]) over sequence b's first ``lens[b]`` cached tokens."""
    lib = library()
    assert lib is not None
    b, h, d = query.shape
    _, bs, hkv, _ = key_cache.shape
    tables = block_tables[:b].to(torch.int32).contiguous()
    lens_t = seq_lens[:b].to(torch.int32).contiguous()
    code = lib.lbd_paged_decode_f32(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens_t.data_ptr(), out.data_ptr(), out.stride(0), h, hkv, d, bs, scale, b,
        max(lens, default=0))
    if code:
        raise MemoryError("CPU decode attention could not allocate its score buffer")


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference's contract (fp32 caches): decodes here in C, prefill chunks through the reference."""
    query_lens, seq_lens = _ref.host_lens(meta)
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        paged_decode(query[:nd], key_cache, value_cache, meta.block_tables, meta.seq_lens, seq_lens[:nd],
                     scale, out)
    _ref.attend_prefills(query, key_cache, value_cache, meta, query_lens, seq_lens, scale, out)
    return out
