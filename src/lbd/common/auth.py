"""API keys: ``Authorization: Bearer <key>`` checked in constant time against every configured key.

Keys are kept only as SHA-256 digests; a presented token is hashed and compared with every digest (no early
exit), so neither the match position nor a key's length shows in the timing. A key's ``name`` is what logs and
metrics may show: the name given in a key file, else ``key-`` and 8 hex digits of its digest.

Paths that stay open without a key follow vLLM: health and readiness probes, ``/ping``, ``/load``,
``/version`` and ``/metrics`` (so orchestrators, supervisors and scrapers need no secret); everything else
needs one.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PUBLIC_PATHS = frozenset(
    {"/health", "/healthz", "/readyz", "/ping", "/load", "/version", "/metrics", "/telemetry"}
)
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: one key
API_KEYS_ENV = "LBD_API_KEYS"  # ours: several keys, one per line (how lbd supervise hands keys to its ranks)


@dataclass(slots=True, frozen=True)
class ApiKey:
    name: str
    digest: bytes
    rps: float | None = None  # per-key request rate limit (router), None = the default
    tps: float | None = None  # per-key token rate limit (router), None = the default
    # flow control (lbd.router.flow): the key's tenant (None: the key's name), its tenant's weight in the
    # fair shares, and the most important priority it may ask for (lower is more important, as vLLM's
    # ``priority``; None: any)
    tenant: str | None = None
    weight: float = 1.0
    max_priority: int | None = None


def digest(secret: str | bytes) -> bytes:
    raw = secret.encode("utf-8", "surrogateescape") if isinstance(secret, str) else secret
    return hashlib.sha256(raw).digest()


def make_key(secret: str, name: str | None = None, rps: float | None = None,
             tps: float | None = None, tenant: str | None = None, weight: float = 1.0,
             max_priority: int | None = None) -> ApiKey:
    d = digest(secret)
    return ApiKey(name or f"key-{d.hex()[:8]}", d, rps, tps, tenant, weight, max_priority)


def bearer_token(value: str | bytes | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` value, as bytes (any bytes: a value that is not
    UTF-8 is simply a wrong key, never an error)."""
    if value is None:
        return None
    raw = value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
    scheme, _, token = raw.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    token = token.strip()
    return token or None


class KeyRing:
    """The accepted keys; empty means authentication is off."""

    __slots__ = ("keys",)

    def __init__(self, keys: Iterable[ApiKey] = ()) -> None:
        self.keys = tuple(keys)

    @classmethod
    def from_secrets(cls, secrets: Iterable[str]) -> KeyRing:
        return cls(make_key(s) for s in secrets if s)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def match(self, token: bytes | None) -> ApiKey | None:
        """The key ``token`` is, or None; the time taken does not depend on which key (if any) matched."""
        presented = digest(token if token is not None else b"")
        found: ApiKey | None = None
        for key in self.keys:
            if hmac.compare_digest(presented, key.digest) and token is not None:
                found = key
        return found

    def check_header(self, authorization: str | bytes | None) -> ApiKey | None:
        return self.match(bearer_token(authorization))


def key_lines(text: str) -> list[str]:
    """The keys of an environment variable that holds one per line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def engine_secrets(flag_values: Iterable[str] | None, env: dict[str, str]) -> list[str]:
    """An engine's keys as given: ``--api-key`` values, ``$VLLM_API_KEY``, the lines of ``$LBD_API_KEYS``."""
    secrets = list(flag_values or [])
    if env.get(API_KEY_ENV):
        secrets.append(env[API_KEY_ENV])
    return secrets + key_lines(env.get(API_KEYS_ENV, ""))


def engine_keys(flag_values: Iterable[str] | None, env: dict[str, str]) -> KeyRing:
    return KeyRing.from_secrets(engine_secrets(flag_values, env))


_KEY_FIELDS = ("name", "rps", "tps", "tenant", "weight", "max_priority")
TENANT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@/-")
MAX_TENANT_LEN = 64


def tenant_problem(name: str) -> str | None:
    """Why ``name`` is not a tenant name (1 to 64 of letters, digits and ``._:@/-``), or None."""
    if not 0 < len(name) <= MAX_TENANT_LEN or not set(name) <= TENANT_CHARS:
        return f"a tenant is 1 to {MAX_TENANT_LEN} of letters, digits and ._:@/- (got {name[:80]!r})"
    return None


def read_key_file(path: Path) -> list[ApiKey]:
    """One key per line: ``<key> [name=<name>] [rps=<requests/s>] [tps=<tokens/s>] [tenant=<tenant>]
    [weight=<share>] [max_priority=<int>]``; ``#`` starts a comment. ``tenant`` (default: the key's name),
    ``weight`` (default 1) and ``max_priority`` (the most important priority the key may ask for; lower is
    more important; default: any) are flow control's (lbd.router.flow): keys of one tenant share its queue
    and must give it the same weight. Raises ValueError naming the line for anything else."""
    keys: list[ApiKey] = []
    weights: dict[str, float] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        options: dict[str, str] = {}
        for item in fields[1:]:
            k, eq, v = item.partition("=")
            if not eq or k not in _KEY_FIELDS or not v:
                raise ValueError(f"{where}: expected {'=, '.join(_KEY_FIELDS)}= after the key, got {item!r}")
            options[k] = v
        key = _key_from(fields[0], options, where)
        tenant = key.tenant or key.name
        if weights.setdefault(tenant, key.weight) != key.weight:
            raise ValueError(f"{where}: tenant {tenant} has weight {weights[tenant]:g} on another key: "
                             "give its keys one weight")
        keys.append(key)
    return keys


def _key_from(secret: str, options: dict[str, str], where: str) -> ApiKey:
    """One key file line's key, its options checked."""
    try:
        rps = float(options["rps"]) if "rps" in options else None
        tps = float(options["tps"]) if "tps" in options else None
        weight = float(options.get("weight", "1"))
    except ValueError:
        raise ValueError(f"{where}: rps, tps and weight must be numbers") from None
    if (rps is not None and rps <= 0) or (tps is not None and tps <= 0) or not 0 < weight < 1e6:
        raise ValueError(f"{where}: rps, tps and weight must be positive (weight below 1e6)")
    max_priority = None
    if "max_priority" in options:
        try:
            max_priority = int(options["max_priority"])
        except ValueError:
            raise ValueError(f"{where}: max_priority must be an integer") from None
    tenant = options.get("tenant")
    if tenant is not None and (problem := tenant_problem(tenant)):
        raise ValueError(f"{where}: {problem}")
    return make_key(secret, options.get("name"), rps, tps, tenant, weight, max_priority)
