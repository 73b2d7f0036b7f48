"""Who a request is, for flow control: its tenant, the tenant's weight, its priority class, its deadline.

- Tenant: with API keys on, the key's (``tenant=`` in the key file, else the key's name) and its weight
  (``weight=``, default 1); a client's tenant header is then ignored (a key cannot speak for another
  tenant). Without keys, llm-d's header ``x-gateway-inference-fairness-id`` names it (weight 1), else the
  tenant is ``default``.
- Class: vLLM's ``priority`` (an integer, lower is more important, default 0), read as the engine reads it:
  vLLM's ``X-Vllm-Priority`` header when it is an integer, else the body's ``priority``; else the router-only
  header ``x-lbd-priority`` (for clients that cannot set body fields: the engine does not see it). Every
  one of them is numbered as vLLM numbers it: a negative class is more urgent than 0, never "sheddable".
  Which classes are sheddable is the operator's (``--flow-sheddable-priority N``: N and higher numbers,
  the least important; ``FlowSettings.sheddable``), not a second meaning of the client's number: llm-d's
  "below 0 is sheddable" would shed exactly the requests a vLLM client marked most urgent.
- A key's ``max_priority`` bounds the class it may ask for: a more important one is refused (403), not
  clamped, because the engine would still read the body's value; a request of that key that asks none is
  of class ``max_priority`` (when above 0) in the router.
- ``x-lbd-ttft-deadline-ms``: the time to first token the client will wait for; a request that cannot be
  dispatched within it is answered 503 early (``lbd.router.flow.control``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lbd.common.auth import ApiKey, tenant_problem
from lbd.router.messages import Headers
from lbd.router.routed import Refused

TENANT_HEADER = "x-gateway-inference-fairness-id"
PRIORITY_HEADER = "x-lbd-priority"
ENGINE_PRIORITY_HEADER = "X-Vllm-Priority"
DEADLINE_HEADER = "x-lbd-ttft-deadline-ms"
DEFAULT_TENANT = "default"
_INT64 = 1 << 63


@dataclass(slots=True, frozen=True)
class Who:
    """A request's flow (tenant and class), the tenant's weight, and its deadline (s after arrival)."""

    tenant: str
    priority: int
    weight: float = 1.0
    deadline_s: float | None = None


def _bad(message: str, param: str) -> Refused:
    return Refused(400, message, "BadRequestError", param)


def _int(text: str | None) -> int | None:
    """``text`` as a signed 64-bit integer, or None."""
    if text is None:
        return None
    try:
        n = int(text.strip())
    except ValueError:
        return None
    return n if -_INT64 <= n < _INT64 else None


def _priority(headers: Headers, data: dict[str, Any] | None) -> int | None | Refused:
    """The class asked for, as the engine reads it, else the router's header; None: none asked."""
    n = _int(headers.get(ENGINE_PRIORITY_HEADER))
    if n is not None:
        return n
    body = data.get("priority") if data is not None else None
    if body is not None:
        if isinstance(body, bool) or not isinstance(body, int) or not -_INT64 <= body < _INT64:
            return _bad(f"priority must be an integer (lower is more important), got {body!r}", "priority")
        return body
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    n = _int(raw)
    if n is None:
        return _bad(f"{PRIORITY_HEADER} must be an integer (lower is more important), got {raw[:40]!r}",
                    PRIORITY_HEADER)
    return n


def _deadline(headers: Headers) -> float | None | Refused:
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 < ms < 1e9:
        return _bad(f"{DEADLINE_HEADER} must be a positive number of milliseconds, got {raw[:40]!r}",
                    DEADLINE_HEADER)
    return ms / 1000


def classify(headers: Headers, data: dict[str, Any] | None, key: ApiKey | None) -> Who | Refused:
    """The request's flow and deadline, or its refusal (a malformed header or priority: 400; a class its
    key may not ask for: 403)."""
    priority = _priority(headers, data)
    if isinstance(priority, Refused):
        return priority
    deadline = _deadline(headers)
    if isinstance(deadline, Refused):
        return deadline
    if key is not None:
        if priority is None:  # none asked: 0, or the most important its key allows if that is less
            priority = max(0, key.max_priority or 0)
        elif key.max_priority is not None and priority < key.max_priority:
            return Refused(403, f"API key {key.name} may ask for priority {key.max_priority} or higher "
                           f"numbers (lower is more important), not {priority}", "PermissionDeniedError",
                           "priority")
        return Who(key.tenant or key.name, priority, key.weight, deadline)
    priority = priority or 0
    tenant = headers.get(TENANT_HEADER)
    if tenant is None:
        return Who(DEFAULT_TENANT, priority, 1.0, deadline)
    problem = tenant_problem(tenant)
    if problem is not None:
        return _bad(f"{TENANT_HEADER}: {problem}", TENANT_HEADER)
    return Who(tenant, priority, 1.0, deadline)
