"""All-reduce of a CPU TP group through shared memory (gloo over loopback TCP costs milliseconds per call,
whatever the size; this costs microseconds when the members run on their own cores: benchmarks/RESULTS.md,
"CPU all-reduce").

One /dev/shm segment per TP group: a flag per member (the number of the last all-reduce it wrote, one cache
line each) and two buffers of one slot per member. All-reduce number n: each member copies its tensor into its
slot of buffer n % 2, publishes n in its flag, waits until every flag reaches n, and sums the slots in rank
order (so every member gets the same bits). Two buffers are enough: a member writes buffer n % 2 again only at
n + 2, after every member has published n + 1, that is after every member finished reading n.

The wait spins briefly, then yields the CPU, then blocks on a futex of the late member's flag (each member
bumps its futex word and wakes it after publishing), so a waiter neither burns the CPU an oversubscribed
peer needs nor oversleeps its arrival; it gives up after the group's timeout. x86-64 only: its stores become
visible in program order, so a flag is never seen before the data written ahead of it (and the futex
syscall number is x86-64's). Tensors larger than a slot, and every other collective, go through gloo;
which path an all-reduce takes depends only on its size, the same on every member.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # per member and buffer: a 512-token step of a 2048-wide model in fp32
_FLAG_STRIDE = 8  # int64s per flag: one 64-byte cache line each
_SPINS, _YIELDS = 200, 50  # then the futex
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64; shared (not FUTEX_PRIVATE) across processes
_WAIT_SLICE_NS = 50_000_000  # a futex wait re-checks the deadline this often
_LIBC = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
ENV_OFF = "LBD_SHM_ALLREDUCE"  # "0": use gloo for every all-reduce


def available() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.environ.get(ENV_OFF, "1") != "0" \
        and os.path.isdir("/dev/shm")


class ShmAllReduce:
    def __init__(self, path: str, create: bool, members: int, index: int, timeout_s: float) -> None:
        self.members, self.index, self.timeout_s = members, index, timeout_s
        header = members * _FLAG_STRIDE * 8
        size = header + 2 * members * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path = path
        self._flags = np.frombuffer(self._mm, dtype=np.int64, count=members * _FLAG_STRIDE)[::_FLAG_STRIDE]
        # a 32-bit futex word beside each flag, in the same cache line
        self._words = np.frombuffer(self._mm, dtype=np.uint32, count=members * _FLAG_STRIDE * 2)[
            2::_FLAG_STRIDE * 2]
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self._word_addr = [base + m * _FLAG_STRIDE * 8 + 8 for m in range(members)]
        self._slice = _Timespec(0, _WAIT_SLICE_NS)
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=header)
        self._seq = 0

    @staticmethod
    def new_path() -> str:
        return f"/dev/shm/lbd-tp-{os.getpid()}-{secrets.token_hex(6)}"

    def unlink(self) -> None:
        """Remove the name once every member has it mapped (the memory lives until the last unmaps it)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def _slot(self, buf: int, member: int, x: torch.Tensor) -> torch.Tensor:
        start = (buf * self.members + member) * SLOT_BYTES
        return self._data[start:start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place."""
        self._seq += 1
        seq, buf = self._seq, self._seq % 2
        self._slot(buf, self.index, x).copy_(x)
        self._flags[self.index] = seq
        self._words[self.index] = seq & 0xFFFFFFFF
        _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self._word_addr[self.index]), _FUTEX_WAKE, 0x7FFFFFFF,
                      None, None, 0)
        self._wait(seq)
        x.copy_(self._slot(buf, 0, x))
        for member in range(1, self.members):
            x.add_(self._slot(buf, member, x))
        return x

    def _wait(self, seq: int) -> None:
        flags = self._flags
        for i in range(_SPINS + _YIELDS):
            if flags.min() >= seq:
                return
            if i >= _SPINS:
                os.sched_yield()
        deadline = time.monotonic() + self.timeout_s
        while True:
            late = int(flags.argmin())
            word = int(self._words[late])  # read before re-checking: a wake in between changes the word
            if flags[late] >= seq:
                if flags.min() >= seq:
                    return
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"shared-memory all-reduce {seq}: members {list(flags)} did not arrive "
                                   f"within --distributed-timeout-s {self.timeout_s:g}")
            # sleeps until that member publishes (or the slice ends); returns at once if it already did
            _LIBC.syscall(_SYS_FUTEX, ctypes.c_void_p(self._word_addr[late]), _FUTEX_WAIT,
                          ctypes.c_uint32(word), ctypes.byref(self._slice), None, 0)

    def close(self) -> None:
        self._data = None  # type: ignore[assignment]
        self._flags = self._words = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a tensor still viewing a slot keeps the mapping alive
            self._mm.close()
