"""Build and load the C kernels of ``lbd.kernels.cpu``: the system C compiler at first use, ctypes to load.

Why ctypes and not a torch extension: plain C files with no torch headers compile in about a second, so the
engine can build them at start-up on any machine with ``cc``; the ``.so`` is cached per sources, flags and CPU
under ``$LBD_CACHE_DIR/kernels`` (default ``~/.cache/lbd/kernels``). Without a compiler, or when the build
fails, ``library()`` returns None and callers keep the torch references (logged once).

Threads: the kernels are OpenMP; their ``libgomp.so.1`` resolves to the copy torch has loaded, so they share
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

logger = logging.getLogger("lbd.kernels.cpu")
_SOURCES = [Path(__file__).with_name(n)
            for n in ("pool.c", "paged_decode.c", "elementwise.c", "packed_gemm.c", "decoder.c")]
_HEADERS = [Path(__file__).with_name(n) for n in ("pool.h", "vexp.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-fno-math-errno", "-shared", "-fPIC"]
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {  # name: (restype, argtypes)
    "lbd_paged_decode_f32": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                            _I64, _I64, _F32, _I64, _I64]),
    "lbd_paged_decode_bf16": (ctypes.c_int, [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                             _I64, _I64, _F32, _I64, _I64]),
    "lbd_write_kv": (None, [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64]),
    "lbd_rms_norm_f32": (None, [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32]),
    "lbd_rotary_neox_f32": (None, [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64]),
    "lbd_silu_and_mul_f32": (None, [_PTR, _I64, _PTR, _I64, _I64]),
    "lbd_argmax_f32": (None, [_PTR, _I64, _I64, _I64, _PTR]),
    "lbd_decoder_f32": (ctypes.c_int, [_PTR, _I64, _PTR, _F32, _F32, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64,
                                       _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR]),
    "lbd_bind_threads": (ctypes.c_int, [_PTR, ctypes.c_int]),
    "lbd_pool_start": (ctypes.c_int, [_PTR, ctypes.c_int]),
    "lbd_pool_threads": (ctypes.c_int, []),
    "lbd_packed_gemm_support": (ctypes.c_int, []),
    "lbd_packed_size": (_I64, [_I64, _I64, ctypes.c_int]),
    "lbd_pack_f32": (None, [_PTR, _I64, _I64, _I64, _PTR]),
    "lbd_pack_bf16": (None, [_PTR, _I64, _I64, _I64, _PTR]),
    "lbd_packed_gemm_f32": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]),
    "lbd_packed_gemm_bf16": (ctypes.c_int, [_PTR, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]),
}
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
    sources = b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])
    digest = hashlib.sha256(sources + " ".join(_FLAGS).encode() + _cpu_key()).hexdigest()[:16]
    target = _cache_dir() / f"lbd-cpu-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *_FLAGS, "-o", tmp, *map(str, _SOURCES), "-lm"], check=True, capture_output=True,
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
        logger.warning("no C compiler (cc/gcc) found: the CPU uses the slower torch references")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the CPU kernels failed (%s %s): using the torch references", e,
                       detail.decode(errors="replace")[-500:])
        return None
    _lib = bind(lib)
    return lib


def bind(lib: ctypes.CDLL, strict: bool = True) -> ctypes.CDLL:
    """Declare the kernels' C signatures on ``lib``. ``strict=False`` (a benchmark's build of another
    revision's sources) skips the entry points that build lacks instead of raising AttributeError."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name) if strict else getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib
