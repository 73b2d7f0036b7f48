"""One registry: plugins by kind and name, and the named profiles (policies) made of them.

A plugin module registers its classes with ``@plugin``; a profile module registers a builder with
``@profile(name, help)`` (a function of the policy's options that returns a ``Profile``). ``make_policy``
builds a profile by name; ``register_profile`` adds one composed at run time (``--routing-config``).
``MODULES`` lists the modules that register built-in plugins and profiles: a new plugin is a new module
and its line here.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from lbd.policies.plugin import Plugin

if TYPE_CHECKING:
    from lbd.policies.profile import Profile

MODULES = (
    "lbd.policies.filters",
    "lbd.policies.pick",
    "lbd.policies.scorers",
    "lbd.policies.affinity",
    "lbd.policies.ttft",
    "lbd.policies.overlap",
    "lbd.policies.roles",
    "lbd.policies.adapters",
    "lbd.policies.profiles",
)
P = TypeVar("P", bound=type[Plugin])
KINDS = ("filter", "scorer", "picker")
_PLUGINS: dict[str, dict[str, type[Plugin]]] = {k: {} for k in KINDS}
_PROFILES: dict[str, tuple[Callable[..., Profile], str]] = {}
_BUILTIN: set[str] = set()
_PREFILL: dict[str, str] = {}  # a composed profile -> the profile P/D's prefill stage runs by
PD_PREFILL = "pd_prefill"  # the prefill stage's profile unless a routing config names another


def plugin(cls: P) -> P:
    """Register a plugin class under its ``kind`` and ``name``."""
    table = _PLUGINS.get(cls.kind)
    if table is None or not cls.name or cls.name in table:
        raise ValueError(f"plugin {cls.kind}/{cls.name!r}: unknown kind, empty name or name taken")
    table[cls.name] = cls
    return cls


def plugins(kind: str) -> dict[str, type[Plugin]]:
    """The registered plugins of ``kind`` by name."""
    return dict(sorted(_PLUGINS[kind].items()))


def plugin_class(kind: str, name: str) -> type[Plugin]:
    cls = _PLUGINS[kind].get(name)
    if cls is None:
        known = ", ".join(sorted(_PLUGINS[kind]))
        raise KeyError(f"{kind} {name!r} is not registered; registered {kind}s: {known}")
    return cls


def plugin_options(cls: type[Plugin]) -> dict[str, Any]:
    """A plugin's options and their defaults (its constructor's keyword parameters after ``env``)."""
    out: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "env") or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        out[name] = param.default
    return out


def profile(name: str, help: str) -> Callable[[Callable[..., Profile]], Callable[..., Profile]]:
    """Register a built-in profile's builder."""

    def add(builder: Callable[..., Profile]) -> Callable[..., Profile]:
        if name in _PROFILES:
            raise ValueError(f"policy name {name!r} is taken")
        _PROFILES[name] = (builder, help)
        _BUILTIN.add(name)
        return builder

    return add


def register_profile(name: str, builder: Callable[..., Profile], help: str,
                     prefill: str | None = None) -> None:
    """Add (or replace) a profile composed at run time; a built-in policy's name is refused. ``prefill``: the
    registered profile a P/D prefill stage runs by when this one is the policy (None: ``pd_prefill``)."""
    if not name or name in _BUILTIN:
        raise ValueError(f"profile name {name!r} is empty or a built-in policy's")
    if prefill is not None and prefill not in _PROFILES:
        raise ValueError(f"prefill profile {prefill!r} is not registered")
    _PROFILES[name] = (builder, help)
    _PREFILL.pop(name, None)
    if prefill is not None:
        _PREFILL[name] = prefill


def prefill_profile(policy: str) -> str:
    """The profile P/D's prefill stage runs by when ``policy`` decides the decode stage."""
    return _PREFILL.get(policy, PD_PREFILL)


def unregister_profile(name: str) -> None:
    """Remove a profile added by ``register_profile`` (tests)."""
    if name not in _BUILTIN:
        _PROFILES.pop(name, None)
        _PREFILL.pop(name, None)


def builtin_names() -> set[str]:
    """The built-in policies' names (a composed profile may not take one)."""
    return set(_BUILTIN)


def available() -> dict[str, str]:
    """Registered policy (profile) names with their one-line help."""
    return {name: help for name, (_, help) in sorted(_PROFILES.items())}


def make_policy(name: str, **options: Any) -> Profile:
    """The profile ``name`` built with ``options`` (settings it does not take are ignored: the router passes
    every policy the same ones)."""
    entry = _PROFILES.get(name)
    if entry is None:
        raise KeyError(f"unknown policy {name!r}; known: {', '.join(sorted(_PROFILES))}")
    return entry[0](**options)


def load() -> None:
    """Import every module of ``MODULES`` (each registers its plugins or profiles as it is imported)."""
    for name in MODULES:
        importlib.import_module(name)
