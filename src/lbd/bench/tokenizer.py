"""The real tokenizer for prompt lengths, loaded without torch.

``--tokenizer PATH`` (a tokenizer folder or a .gguf file), else the default model's converted folder, else the
default GGUF. Reading a GGUF's tokenizer goes through transformers' GGUF loader, which imports torch: it runs
once in a child process that saves a plain tokenizer folder to the cache, so this process stays light.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lbd.engine.config.model_files import ModelNotFoundError, cache_root, converted_path, default_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class TokenizerError(RuntimeError):
    pass


_EXTRACT = """
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf, out = Path(sys.argv[1]), sys.argv[2]
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
"""


def _from_gguf(gguf: Path) -> Path:
    """A tokenizer folder extracted from ``gguf`` (once, in a child process) and cached."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_root() / "tokenizers" / f"{gguf.stem}-{key}"
    if (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _EXTRACT, str(gguf), str(tmp)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not (tmp / "tokenizer.json").is_file():
        tail = (proc.stderr or "").strip().splitlines()[-1:] or ["no tokenizer.json written"]
        raise TokenizerError(f"cannot read the tokenizer of {gguf}: {tail[0]} (pass --tokenizer FOLDER)")
    os.replace(tmp, out) if not out.exists() else None
    return out


def _default_folder() -> Path:
    try:
        gguf = default_gguf()
    except ModelNotFoundError as e:
        raise TokenizerError(f"{e} (or pass --tokenizer FOLDER)") from e
    converted = converted_path(gguf)
    return converted if (converted / "tokenizer.json").is_file() else _from_gguf(gguf)


def tokenizer_folder(spec: str | None) -> Path:
    if spec is None:
        return _default_folder()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return path
    if path.is_dir() and sorted(path.glob("*.gguf")):
        return _from_gguf(sorted(path.glob("*.gguf"))[0])
    raise TokenizerError(f"--tokenizer {spec!r}: not a folder with tokenizer.json nor a .gguf file")


def load_tokenizer(spec: str | None) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_folder(spec)
    return PreTrainedTokenizerFast.from_pretrained(str(folder))
