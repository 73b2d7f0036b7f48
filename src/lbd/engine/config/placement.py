"""Where a rank and its workers run: CPU sets and thread counts, visible CUDA devices. No torch.

CPU. The node's cores are split twice: ``lbd supervise`` gives each local rank a slice of its CPUs and passes
it in ``LBD_RANK_CPUS`` (e.g. ``"0-3"``); the rank's core process pins itself there and, with TP x PP workers,
splits that set again, one contiguous slice per worker (``split_cpus``). Without ``LBD_RANK_CPUS`` (a plain
``lbd serve``) the rank's set is the CPUs it may run on, and its thread count is that set's size divided by
``--data-parallel-size-local`` (today's rule); ``OMP_NUM_THREADS`` always wins for the thread count. When a
set has fewer CPUs than it must be split into, every part gets one CPU, round robin: oversubscribed, which is
allowed (and logged) on the CPU, where it is still correct, only slower.

CUDA. The visible devices are ``CUDA_VISIBLE_DEVICES`` when set, else every NVIDIA device of the machine
(read from /proc or /dev, without loading the driver). A rank's workers take its devices in local-index order
(``ParallelLayout.local_index``).
"""

from __future__ import annotations

import os
from pathlib import Path

RANK_CPUS_ENV = "LBD_RANK_CPUS"


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the kernel's cpulist syntax)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def parse_cpus(text: str) -> list[int]:
    """"0-2,5" -> [0, 1, 2, 5]; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return sorted(cpus)


def split_cpus(cpus: list[int], parts: int) -> list[list[int]]:
    """``parts`` contiguous, disjoint slices of ``cpus`` (the first ones one CPU larger when it does not
    divide); with fewer CPUs than parts, one CPU each, round robin."""
    cpus = sorted(cpus)
    if len(cpus) < parts:
        return [[cpus[i % len(cpus)]] for i in range(parts)]
    base, extra = divmod(len(cpus), parts)
    out, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append(cpus[start:start + n])
        start += n
    return out


def rank_cpus(env: dict[str, str] | None = None) -> list[int]:
    """The CPUs this rank may use: ``LBD_RANK_CPUS`` when the supervisor set it, else our affinity."""
    env = os.environ if env is None else env
    if env.get(RANK_CPUS_ENV):
        return parse_cpus(env[RANK_CPUS_ENV])
    return sorted(os.sched_getaffinity(0))


def pin_to_rank_cpus(env: dict[str, str] | None = None) -> list[int] | None:
    """Pin this process to ``LBD_RANK_CPUS`` when the supervisor set it (the core does it at start)."""
    env = os.environ if env is None else env
    if not env.get(RANK_CPUS_ENV):
        return None
    cpus = parse_cpus(env[RANK_CPUS_ENV])
    os.sched_setaffinity(0, cpus)
    return cpus


def rank_threads(dp_size_local: int | None, dp_size: int = 1, env: dict[str, str] | None = None) -> int:
    """Compute threads of this rank: OMP_NUM_THREADS if set; the size of LBD_RANK_CPUS (already this rank's
    share); else our CPUs divided by the local DP ranks."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS"):
        return max(1, int(env["OMP_NUM_THREADS"]))
    cpus = rank_cpus(env)
    if env.get(RANK_CPUS_ENV):
        return len(cpus)
    ranks = dp_size_local or dp_size or 1
    return max(1, len(cpus) // max(1, ranks))


def nvidia_device_count() -> int:
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return sum(1 for _ in proc.iterdir())
    return sum(1 for _ in Path("/dev").glob("nvidia[0-9]*"))


def visible_cuda_devices(env: dict[str, str], device: str) -> list[str] | None:
    """The inherited CUDA device ids, or None when the ranks will not run on CUDA."""
    if device in ("cpu", "sim"):
        return None
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(nvidia_device_count())]
    if not ids and device != "cuda":
        return None  # device auto on a machine without GPUs: the engine falls back to the CPU
    return ids
