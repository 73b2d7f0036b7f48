"""Build and load the C kernels of ``lbd.kernels.cpu``: the system C compiler at first use, ctypes to load.

Why ctypes and not a torch extension: plain C files with no torch headers compile in about a second, so the
engine can build them at start-up on any machine with ``cc``; the ``.so`` is cached per sources, flags and CPU
under ``$LBD_CACHE_DIR/kernels`` (default ``~/.cache/lbd/kernels``). Without a compiler, or when the build
fails, ``library()`` returns None and callers keep the torch references (logged once).

Instruction-set levels: the C files hold an AVX-512 BF16, an AVX-512, an AVX2 and a portable path of each
kernel, picked at compile time by the ``__AVX512BF16__``/``__AVX512F__``/``__AVX2__`` macros. Each level
(``LEVELS``: scalar, avx2, avx512, avx512bf16) is its own build: ``-march=native``, minus the instructions
above the level (``-mno-avx512bf16``, ``-mno-avx512f``, ``-mno-avx``; "scalar" is the portable C, which the
compiler may still vectorise with SSE), cached under its own name, so the levels coexist in one process (each
``.so`` is loaded RTLD_LOCAL with its own thread pool). The default is the best level this CPU runs;
``LBD_CPU_ISA`` caps it for the whole process (the engine then runs that level's paths: a big machine
behaves as a smaller one), and tests pick a level per test, at most the cap, with ``using(level)`` or
``library(level)``. A level the CPU cannot execute, one above the cap, or one the compiler did not enable is
refused with a ValueError naming the missing instruction set: never run silently.

Threads: the kernels are OpenMP; their ``libgomp.so.1`` resolves to the copy torch has loaded, so they share
torch's thread pool and ``torch.set_num_threads``. (A Python thread pool splitting the batch, tried first,
lost ~0.8 ms per layer waiting for its worker while torch's OpenMP threads spun on the same cores.)
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger("lbd.kernels.cpu")
_SOURCES = [Path(__file__).with_name(n)
            for n in ("pool.c", "paged_decode.c", "elementwise.c", "packed_gemm.c", "decoder.c")]
_HEADERS = [Path(__file__).with_name(n) for n in ("pool.h", "vexp.h")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-fno-math-errno", "-shared", "-fPIC"]

LEVELS = ("scalar", "avx2", "avx512", "avx512bf16")  # lowest first; lbd_isa() returns the index
# the /proc/cpuinfo flags a level's code needs, and the compiler flags that take the levels above it away
_NEEDS = {"scalar": (), "avx2": ("avx2", "fma"), "avx512": ("avx2", "fma", "avx512f"),
          "avx512bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")}
_CAP_FLAGS = {"scalar": ["-mno-avx"], "avx2": ["-mno-avx512f"], "avx512": ["-mno-avx512bf16"],
              "avx512bf16": []}

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
    "lbd_isa": (ctypes.c_int, []),
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
_libs: dict[str, ctypes.CDLL | None] = {}  # level -> its loaded build (None: no compiler / build failed)
_default: str | None = None  # the process's cap (LBD_CPU_ISA, else the best), resolved at first use
_override: str | None = None  # set by using()


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


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    line = _cpu_key().decode(errors="replace")
    return frozenset(line.split(":", 1)[1].split()) if line.startswith("flags") else frozenset()


def missing(level: str, flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The instruction sets ``level`` needs that the CPU (or ``flags``) lacks; empty when it can run it."""
    if level not in LEVELS:
        raise ValueError(f"unknown CPU kernel level {level!r}: use one of {', '.join(LEVELS)}")
    if level != "scalar" and not _x86() and flags is None:
        return ("x86-64",)
    have = cpu_flags() if flags is None else flags
    return tuple(f for f in _NEEDS[level] if f not in have)


def levels(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The levels this CPU (or one with ``flags``) can execute, lowest first; "scalar" always."""
    return tuple(lv for lv in LEVELS if not missing(lv, flags))


def refusal(level: str, cap_level: str | None = None, flags: frozenset[str] | None = None) -> str | None:
    """Why a process capped at ``cap_level`` (none: no cap) on this CPU (or one with ``flags``) may not run
    ``level``, in the words ``check`` and ``allowed`` raise; None when it may. A pure function of its
    arguments once ``flags`` is given, so each message can be shown for any CPU."""
    lacks = missing(level, flags)
    if lacks:
        return (f"CPU kernel level {level}: this CPU lacks {', '.join(lacks)}; use one of "
                f"{', '.join(levels(flags))} (LBD_CPU_ISA), or leave LBD_CPU_ISA unset for the best it runs")
    if cap_level is not None and LEVELS.index(level) > LEVELS.index(cap_level):
        return (f"CPU kernel level {level} is above LBD_CPU_ISA={cap_level}: unset LBD_CPU_ISA or raise it "
                "to run it")
    return None


def check(level: str, flags: frozenset[str] | None = None) -> str:
    """``level`` when the CPU (or one with ``flags``) can execute it, else a ValueError naming what it lacks
    and the fix."""
    why = refusal(level, None, flags)
    if why:
        raise ValueError(why)
    return level


def _env_cap() -> str:
    raw = os.environ.get("LBD_CPU_ISA", "").strip().lower()
    if raw in ("", "native", "auto"):
        return levels()[-1]
    if raw not in LEVELS:
        raise ValueError(f"LBD_CPU_ISA must be one of {', '.join(LEVELS)} (or unset for the best this CPU "
                         f"runs), got {raw!r}")
    return check(raw)


def cap() -> str:
    """The highest level this process may run: LBD_CPU_ISA's (read once), else the best this CPU runs."""
    global _default
    if _default is None:
        _default = _env_cap()
    return _default


def available() -> tuple[str, ...]:
    """The levels this process may run, lowest first: those the CPU executes, up to ``cap()``."""
    return LEVELS[: LEVELS.index(cap()) + 1]


def allowed(level: str) -> str:
    """``level`` when this process may run it, else a ValueError naming the missing instruction set or the
    LBD_CPU_ISA cap."""
    why = refusal(level) or refusal(level, cap())  # what the CPU lacks first, as before the cap
    if why:
        raise ValueError(why)
    return level


def selected() -> str:
    """The level ``library()`` loads now: ``using``'s, else ``cap()``."""
    return _override if _override is not None else cap()


@contextlib.contextmanager
def using(level: str) -> Iterator[None]:
    """Within the block, ``library()`` (and so every kernel wrapper) is ``level``'s build. For tests and
    benchmarks; one thread at a time."""
    global _override
    allowed(level)
    before, _override = _override, level
    try:
        yield
    finally:
        _override = before


def _compile(cc: str, flags: list[str], out: Path) -> None:
    """Each source to an object at once (one compiler per file: the build takes the longest file's time on
    several cores, not the sum), then the objects linked to ``out``. CalledProcessError or TimeoutExpired on
    failure; no compiler outlives the call."""
    objects = [out.with_name(f"{out.stem}-{p.stem}.o") for p in _SOURCES]
    procs = [subprocess.Popen([cc, *flags, "-c", "-o", str(o), str(p)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for p, o in zip(_SOURCES, objects, strict=True)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            if proc.returncode:
                raise subprocess.CalledProcessError(proc.returncode, proc.args, stderr=err)
        subprocess.run([cc, *flags, "-o", str(out), *map(str, objects), "-lm"], check=True,
                       capture_output=True, timeout=120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for o in objects:
            o.unlink(missing_ok=True)


def _build(cc: str, level: str) -> Path:
    flags = _FLAGS + (_CAP_FLAGS[level] if level != levels()[-1] else [])  # the best level: plain native
    sources = b"".join(p.read_bytes() for p in [*_SOURCES, *_HEADERS])
    digest = hashlib.sha256(sources + " ".join(flags).encode() + _cpu_key()).hexdigest()[:16]
    target = _cache_dir() / f"lbd-cpu-{level}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        _compile(cc, flags, Path(tmp))
        os.replace(tmp, target)  # atomic: ranks building at once all end with one whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def library(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels built for ``isa`` (default ``selected()``), or None (no compiler, build failed, or
    LBD_CPU_KERNELS=0). ValueError for a level this CPU or compiler cannot run."""
    level = selected() if isa is None else allowed(isa)
    if level in _libs:
        return _libs[level]
    _libs[level] = None
    if os.environ.get("LBD_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler (cc/gcc) found: the CPU uses the slower torch references")
        return None
    try:
        lib = bind(ctypes.CDLL(str(_build(cc, level))))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("building the CPU kernels failed (%s %s): using the torch references", e,
                       detail.decode(errors="replace")[-500:])
        return None
    built = LEVELS[lib.lbd_isa()]
    if built != level and (isa is not None or _override is not None or os.environ.get("LBD_CPU_ISA")):
        raise ValueError(f"CPU kernel level {level} asked for, but {cc} built {built} (it lacks the "
                         f"-m flags of {level}): use a newer compiler or LBD_CPU_ISA={built}")
    if built != level:
        logger.warning("the CPU runs %s but %s built the kernels for %s", level, cc, built)
    _libs[level] = lib
    return lib


def isa_of(lib: ctypes.CDLL) -> str:
    """The level a loaded build was compiled for."""
    return LEVELS[lib.lbd_isa()]


def bind(lib: ctypes.CDLL, strict: bool = True) -> ctypes.CDLL:
    """Declare the kernels' C signatures on ``lib``. ``strict=False`` (a benchmark's build of another
    revision's sources) skips the entry points that build lacks instead of raising AttributeError."""
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name) if strict else getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib
