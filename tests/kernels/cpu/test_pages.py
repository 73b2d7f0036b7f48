"""lbd.kernels.cpu.pages: large buffers are private anonymous maps, advised for huge pages, read as zeros."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from lbd.kernels.cpu import pages

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)")
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(address: int) -> tuple[str, str]:
    """(permissions, VmFlags) of the mapping of this process that holds ``address``."""
    perms = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = _HEADER.match(line)
        if m:
            perms = m[3] if int(m[1], 16) <= address < int(m[2], 16) else None
        elif perms is not None and line.startswith("VmFlags:"):
            return perms, line
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_buffers_are_private_zeroed_and_advised_for_huge_pages() -> None:
    buf = pages.zeroed(6 * pages.HUGE_PAGE)
    assert buf.dtype == torch.uint8 and buf.numel() == 6 * pages.HUGE_PAGE and not bool(buf.any())
    perms, flags = _mapping_of(buf.data_ptr())
    assert perms.endswith("p")  # MAP_PRIVATE: Python's default MAP_SHARED is shmem, where THP is off
    if _THP.is_file() and "[never]" not in _THP.read_text():
        assert " hg" in flags  # MADV_HUGEPAGE took
    buf[123] = 7
    assert int(buf[123]) == 7


def test_small_buffers_are_plain_tensors() -> None:
    small = pages.buffer(1000, torch.float32)
    assert small.shape == (1000,) and small.dtype == torch.float32
    large = pages.buffer(pages.HUGE_PAGE, torch.bfloat16)  # 4 MB
    assert large.shape == (pages.HUGE_PAGE,) and large.dtype == torch.bfloat16 and not bool(large.any())
