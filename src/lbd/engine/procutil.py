"""Process helpers: die with the parent (PR_SET_PDEATHSIG) and signal whole process trees.

Every child we start calls `set_pdeathsig()` first thing, so a SIGKILL of its parent (which runs no
cleanup) still takes it down; this is what keeps "kill -9 the launcher" from leaving orphans.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal

import psutil

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def set_pdeathsig(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> None:
    """Ask Linux to send `sig` to this process when its parent *thread* dies (no-op off Linux).

    Because it is per thread, parents must start children from their main thread (or a thread that
    lives as long as the process).

    Pass `expected_parent` (the parent's pid, known before the fork/spawn) to close the race where the
    parent dies before this call: then we were already reparented and exit now, as the signal never comes.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def set_process_name(name: str) -> None:
    """The name ps, top and psutil's ``name()`` show (Linux comm, 15 bytes): every spawned child of ours is
    ``python -c ...`` on its command line, so the core is ``lbd-core`` and the tokenizer worker
    ``lbd-tokenize``, for operators and for tests that signal one of them (no-op off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def terminate_tree(pid: int, timeout: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to `pid` and all its descendants, wait up to `timeout`, SIGKILL whatever is left."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=1.0)


def keep_freed_memory() -> None:
    """Stop glibc from returning every large freed block to the OS (no-op off glibc).

    A forward pass allocates and frees the same multi-MB activations every step; by default glibc serves
    each from a fresh mmap and unmaps it on free, so every step page-faults them in again. Keeping them on
    the heap makes such calls several times faster (benchmarks/RESULTS.md, "malloc settings").
    """
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum on 64-bit
    libc.mallopt(m_trim_threshold, 1 << 30)


def freeze_startup_heap() -> None:
    """Move everything start-up made (model modules, tokenizer, config) out of the cyclic GC's reach.

    A serving process allocates a little each step, and now and then that triggers a full collection,
    which walks every tracked object: in an engine core with a model loaded that stalls every stream for
    about a decode step (benchmarks/RESULTS.md, "GC freeze"). After ``gc.freeze()`` a full collection walks
    only what was made since. Call it once, when the process is ready to serve.
    """
    gc.collect()
    gc.freeze()
