"""The converted copy of a GGUF is found by the file's content, not by where it was installed."""

from __future__ import annotations

import os
from pathlib import Path

from lbd.engine.config.model_files import converted_path


def _file(path: Path, data: bytes, mtime_ns: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def test_a_reinstalled_model_finds_the_copy_converted_before(tmp_path: Path) -> None:
    """Two venvs install the same file at other paths and times: one cache folder, not one per install."""
    cache = tmp_path / "cache"
    data = os.urandom(1 << 16)
    first = _file(tmp_path / "venv1" / "m.gguf", data, 1_000_000_000)
    second = _file(tmp_path / "venv2" / "m.gguf", data, 2_000_000_000)
    assert converted_path(first, cache) == converted_path(second, cache)
    assert converted_path(first, cache).parent == cache


def test_an_edited_model_gets_a_new_copy(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = _file(tmp_path / "m.gguf", b"a" * 4096, 1_000_000_000)
    before = converted_path(path, cache)
    _file(path, b"b" * 4096, 1_000_000_001)  # same size and name, new bytes
    assert converted_path(path, cache) != before
    _file(path, b"a" * 4096, 1_000_000_002)  # back to the first bytes: back to the first copy
    assert converted_path(path, cache) == before


def test_a_read_only_cache_still_names_the_copy(tmp_path: Path) -> None:
    """The digest's memo cannot be written: the name is the same, computed each time."""
    path = _file(tmp_path / "m.gguf", b"x" * 4096, 1_000_000_000)
    writable = converted_path(path, tmp_path / "rw")
    blocked = tmp_path / "ro"
    blocked.write_text("a file where the cache folder should be")
    assert converted_path(path, blocked).name == writable.name
