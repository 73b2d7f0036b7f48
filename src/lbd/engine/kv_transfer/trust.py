"""Who a rank trusts with KV blocks: the key producers sign their ``kv_transfer_params`` with, and the proof a
block server gives that it holds that key.

A consumer pulls only from a producer it can authenticate (ARCHITECTURE.md, "P/D trust model"):
- a producer signs the ``kv_transfer_params`` of each finished prefill (``lbd_sig``: an HMAC-SHA256 over the
  engine id, address, transfer id and block ids); a consumer verifies it before it contacts anyone, so a
  client cannot point a decode at an address no producer named;
- the block server answers each pull with a proof (an HMAC of the pull's fresh challenge), so a listener
  that took over the address of a producer gone meanwhile is not read from either.

The key: derived from the cluster token when there is one (every node derives the same), else a random key
kept in a folder only this user can read (``$XDG_RUNTIME_DIR/lbd``, or ``<tmp>/lbd-<uid>``), which every rank
of this user on this machine shares: other users' processes cannot sign, same-user processes could read the
ranks' memory anyway. No key (the folder unusable): the consumer pulls from nobody and recomputes.
Standard library only; nothing here resolves a name.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from lbd.common.cluster import derive, read_cluster_token
from lbd.wire.kv_transfer import KVTransferParams

logger = logging.getLogger(__name__)

KEY_FILE = "kv-transfer.key"
PURPOSE = "kv-transfer/params"


def key_folder(env: Mapping[str, str]) -> Path:
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "lbd"
    return Path(tempfile.gettempdir()) / f"lbd-{os.getuid()}"


def _private(path: Path, kind: int) -> bool:
    """``path`` is ours, of ``kind`` (S_IFDIR/S_IFREG), readable by nobody else."""
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.getuid() and not st.st_mode & 0o077


def local_key(env: Mapping[str, str]) -> bytes | None:
    """This user's machine-local key (made on first use, atomically); None when its folder is not private."""
    folder = key_folder(env)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder, stat.S_IFDIR):
            logger.warning("KV transfer: %s is not a private folder of this user: no local key", folder)
            return None
        path = folder / KEY_FILE
        if not path.exists():
            tmp = folder / f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # the first rank's key wins; the others read it
            tmp.unlink()
        if not _private(path, stat.S_IFREG):
            logger.warning("KV transfer: %s is readable by others: no local key", path)
            return None
        key = path.read_text().strip()
    except OSError as e:
        logger.warning("KV transfer: no local key (%s)", e)
        return None
    return key.encode() if len(key) >= 32 else None


def transfer_key(env: Mapping[str, str] | None = None) -> bytes | None:
    """The key producers sign with and consumers check: the cluster token's, else this user's local one."""
    env = os.environ if env is None else env
    token = read_cluster_token(None, dict(env))
    if token:
        return derive(token, PURPOSE)
    return local_key(env)


def _message(p: KVTransferParams) -> bytes:
    return "\n".join(["lbd-kv-params/1", p.remote_engine_id or "", p.remote_host or "", str(p.remote_port),
                      p.remote_request_id or "", ",".join(map(str, p.block_ids())), str(p.tp_size)]).encode()


def sign(key: bytes, params: KVTransferParams) -> KVTransferParams:
    """``params`` with ``lbd_sig`` set."""
    params.lbd_sig = hmac.new(key, _message(params), hashlib.sha256).hexdigest()
    return params


def signed(key: bytes | None, params: KVTransferParams) -> bool:
    """``params`` were signed with ``key`` (constant time); False without a key or a signature."""
    if key is None or not isinstance(params.lbd_sig, str):
        return False
    try:
        want = hmac.new(key, _message(params), hashlib.sha256).hexdigest()
    except ValueError:
        return False
    return hmac.compare_digest(want, params.lbd_sig)


def proof(key: bytes, challenge: bytes, transfer_id: str) -> str:
    """The block server's answer to a pull's challenge."""
    return hmac.new(key, b"lbd-kv-proof/1\n" + challenge + b"\n" + transfer_id.encode(), hashlib.sha256
                    ).hexdigest()


def numeric_loopback(host: str | None) -> bool:
    """``host`` is a loopback address literal; a name is not (nothing is resolved here: the core thread)."""
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
