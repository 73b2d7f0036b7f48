"""The cluster's own wires: where internal listeners bind, and the token that authenticates them.

Internal listeners (the DP group's store and coordinator, the multi-node head's registration port, TP/PP
rendezvous, KV events, health ports) bind the address their deployment needs: loopback when everything runs
on one machine, the cluster address otherwise, never every interface unless a flag asked for it.

The cluster token (``LBD_CLUSTER_TOKEN`` in the environment, or a file named by ``--cluster-token-file``;
never a command-line value) authenticates every wire that leaves the machine: registrations with the head
(``Authorization: Bearer``), the DP coordinator's HTTP port (the same header) and its ZMQ channel (CURVE, with
key pairs derived from the token, so only token holders complete the handshake and the channel is
encrypted). A process that listens beyond loopback without a token refuses to start unless
``--insecure-cluster`` says so in so many words.

A token must carry at least ``MIN_TOKEN_BITS`` (256) bits by ``token_bits``'s estimate (its length times the
bits per character of the smallest usual alphabet it fits: hex, base64/url-safe, printable ASCII; a token
of few distinct characters counts those only): keys derived from it (CURVE pairs, ``lbd serve``'s internal
key) are only as strong as the token, and an HMAC under it seen on any wire lets a guess be checked offline.
``secrets.token_urlsafe(32)``, ``openssl rand -hex 32`` and ``openssl rand -base64 32`` pass;
``lbd serve``, ``lbd supervise`` and ``lbd route`` refuse a weaker one at start-up with exit 2
(``read_strong_token``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
import socket
import string
import zlib
from collections.abc import Mapping
from typing import Any

from lbd.common.internal_key import INTERNAL_KEY_ENV

CLUSTER_TOKEN_ENV = "LBD_CLUSTER_TOKEN"
LOOPBACK = "127.0.0.1"
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
MAX_TOKEN_FILE_BYTES = 4096
NO_TOKEN_FIX = (f"set {CLUSTER_TOKEN_ENV} (the same secret on every node) or pass --cluster-token-file PATH, "
                "or say --insecure-cluster to run these wires unauthenticated")


MIN_TOKEN_BITS = 256
TOKEN_FIX = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
_ALPHABETS = (set(string.hexdigits), set(string.ascii_letters + string.digits + "-_+/="),
              set(string.printable.strip()))


class ClusterTokenError(ValueError):
    """The token file cannot be read, holds no token, or the token is too weak (one line naming the fix)."""


def token_bits(token: str) -> float:
    """An estimate of the token's entropy: its length x log2 of the smallest usual alphabet holding it (16,
    66, 94 characters, else 8 bits a byte), and no more than its raw-deflate size in bits (a repeated
    pattern compresses; 32 random bytes written out never fall below about 340 bits)."""
    raw = token.encode("utf-8", "surrogateescape")
    chars = set(token)
    size = next((len(a) for a in _ALPHABETS if chars <= a), 0)
    by_alphabet = len(token) * math.log2(size) if size else 8.0 * len(raw)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    return min(by_alphabet, 8.0 * len(deflate.compress(raw) + deflate.flush()))


def check_token_strength(token: str, source: str = CLUSTER_TOKEN_ENV,
                         what: str = "the cluster token") -> None:
    """ClusterTokenError unless ``token`` carries ``MIN_TOKEN_BITS`` (``source``: where it came from)."""
    bits = token_bits(token)
    if bits < MIN_TOKEN_BITS:
        raise ClusterTokenError(
            f"{what} ({source}) is too weak: about {bits:.0f} bits, and at least {MIN_TOKEN_BITS} (32 random "
            f"bytes) are needed, since an HMAC under it can be seen on a wire: make one with {TOKEN_FIX}")


def read_cluster_token(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """The cluster token: the file's first line when ``path`` is given, else ``$LBD_CLUSTER_TOKEN``."""
    env = os.environ if env is None else env
    if path is None:
        return env.get(CLUSTER_TOKEN_ENV) or None
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as e:
        raise ClusterTokenError(f"--cluster-token-file {path}: {e.strerror or e}") from None
    if len(raw) > MAX_TOKEN_FILE_BYTES:
        raise ClusterTokenError(f"--cluster-token-file {path} is over {MAX_TOKEN_FILE_BYTES} bytes: it holds "
                                "one token on its first line")
    token = raw.decode("utf-8", "replace").strip().splitlines()[0].strip() if raw.strip() else ""
    if not token:
        raise ClusterTokenError(f"--cluster-token-file {path} is empty: write the cluster token in it")
    return token


def read_strong_token(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """``read_cluster_token``, refused (ClusterTokenError naming ``$LBD_CLUSTER_TOKEN`` or the file and the
    fix) below ``MIN_TOKEN_BITS``: what every command that takes the token checks at start-up."""
    token = read_cluster_token(path, env)
    if token is not None:
        check_token_strength(token, CLUSTER_TOKEN_ENV if path is None else f"--cluster-token-file {path}")
    return token


def read_strong_internal_key(env: Mapping[str, str] | None = None) -> str | None:
    """``$LBD_INTERNAL_KEY`` (None when unset or empty), refused below ``MIN_TOKEN_BITS`` as the cluster token
    is: its HMACs travel with every forwarded request, so a guessable key could be checked offline."""
    env = os.environ if env is None else env
    key = env.get(INTERNAL_KEY_ENV, "").strip()
    if key:
        check_token_strength(key, INTERNAL_KEY_ENV, "the internal key")
    return key or None


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``; a name that resolves only to loopback counts too."""
    if host is None:
        return False
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def is_wildcard(host: str | None) -> bool:
    return host is None or host in WILDCARDS


def resolve_bind(host: str) -> tuple[int, str]:
    """(address family, numeric address) to bind ``host`` (a name resolves to its first address)."""
    bare = host.strip("[]")
    if bare in WILDCARDS:
        return socket.AF_INET, "0.0.0.0"
    info = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0]
    return info[0], str(info[4][0])


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: the OS picks). OSError when it cannot bind."""
    family, addr = resolve_bind(host)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((addr, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            return name
    return "lo"


def bearer_ok(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer <token>``, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        hashlib.sha256(given.strip().encode("utf-8", "surrogateescape")).digest(),
        hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest())


def derive(token: str, purpose: str) -> bytes:
    """A 32-byte key for one use of the token (HMAC-SHA256), so one wire's key says nothing of another's."""
    return hmac.new(token.encode("utf-8", "surrogateescape"), purpose.encode(), hashlib.sha256).digest()


def _curve_pair(token: str, purpose: str) -> tuple[bytes, bytes]:
    import zmq
    from zmq.utils import z85

    secret = z85.encode(derive(token, purpose))
    return zmq.curve_public(secret), secret


def secure_zmq_server(sock: Any, token: str | None, purpose: str) -> bool:
    """Make ``sock`` a CURVE server whose key pair only token holders can derive (before bind); no-op
    without a token. True when the socket is secured."""
    if not token:
        return False
    import zmq

    public, secret = _curve_pair(token, f"{purpose}/server")
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return True


def secure_zmq_client(sock: Any, token: str | None, purpose: str) -> bool:
    """The client side of ``secure_zmq_server`` (before connect); no-op without a token."""
    if not token:
        return False
    import zmq

    server_public, _ = _curve_pair(token, f"{purpose}/server")
    public, secret = _curve_pair(token, f"{purpose}/client")
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return True
