"""A profile composed from a routing config (``--routing-config FILE``): registered plugins and weights, no
code. The router reads the file; this module checks what it holds and builds the profile.

    {"name": "tenant_mix",
     "filters": ["kv_room", {"plugin": "load_gap", "gap_abs": 4}],
     "scorers": [{"plugin": "queue", "weight": 1}, {"plugin": "prefix_overlap", "weight": 8}],
     "picker": "lowest"}

A filter, scorer or picker is its registered name, or an object with ``plugin`` (the name), its options and
(scorers) ``weight`` (default 1; 0 turns it off). The router's gate (model, pin, health, exclusions) runs in
front of every profile and is not listed. Every mistake is a ``ConfigError`` naming the plugin and the fix.

``prefill`` (optional) is the profile a P/D router's prefill stages run by (the composed one decides the
decode stages, behind the decode role's rule): a registered policy's name, or a profile object of its own
(``name``, ``filters``, ``scorers``, ``picker``); unset: ``pd_prefill`` (the ``prefill_work`` scorer).

    {"name": "pd_mix", "scorers": ["queue"],
     "prefill": {"name": "pd_mix_prefill", "scorers": [{"plugin": "prefill_work"}, {"plugin": "queue",
                                                                                  "weight": 100}]}}
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from lbd.policies.filters import GATE
from lbd.policies.plugin import Env, Filter, Picker, Plugin, Scorer
from lbd.policies.profile import Profile
from lbd.policies.registry import (
    available,
    builtin_names,
    plugin_class,
    plugin_options,
    plugins,
    register_profile,
)

KEYS = ("name", "help", "filters", "scorers", "picker", "prefill")
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")


class ConfigError(ValueError):
    """A routing config that cannot be built, with what to change."""


Spec = tuple[type[Plugin], dict[str, Any], float]


def _option_error(kind: str, name: str, key: str, value: Any, default: Any) -> str | None:
    """Why ``value`` cannot be option ``key`` (None: it can), judged by the option's default."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, bool):
        ok, want = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, want = number and isinstance(value, int), "an integer"
    elif isinstance(default, float) or default is None:
        ok, want = (number and math.isfinite(value)) or (default is None and value is None), "a number"
    else:
        ok, want = isinstance(value, str), "a string"
    return None if ok else f"{kind} {name!r}: option {key!r} must be {want}, not {value!r}"


def _entry(kind: str, item: Any, where: str) -> Spec:
    """One plugin entry (a name, or an object with ``plugin``, options and a scorer's ``weight``)."""
    if isinstance(item, str):
        item = {"plugin": item}
    if not isinstance(item, dict) or not isinstance(item.get("plugin"), str):
        raise ConfigError(f"{where}: give a {kind} as its name or as {{\"plugin\": NAME, ...options}}, "
                          f"not {item!r}")
    options = dict(item)
    name = options.pop("plugin")
    if kind == "filter" and name in {g.name for g in GATE}:
        raise ConfigError(f"filter {name!r} is the router's gate, in front of every profile: leave it out")
    try:
        cls = plugin_class(kind, name)
    except KeyError:
        known = ", ".join(n for n in plugins(kind) if n not in {g.name for g in GATE})
        raise ConfigError(f"{where}: {kind} {name!r} is not registered; use one of: {known}") from None
    weight = 1.0
    if kind == "scorer":
        weight = options.pop("weight", 1.0)
        number = isinstance(weight, (int, float)) and not isinstance(weight, bool)
        if not (number and weight >= 0 and math.isfinite(weight)):
            raise ConfigError(f"scorer {name!r}: weight must be a number >= 0, not {weight!r}")
    known_options = plugin_options(cls)
    for key, value in options.items():
        if key not in known_options:
            listed = ", ".join(known_options) or "none"
            extra = ", weight" if kind == "scorer" else ""
            raise ConfigError(f"{kind} {name!r} has no option {key!r}; its options: {listed}{extra}")
        problem = _option_error(kind, name, key, value, known_options[key])
        if problem:
            raise ConfigError(problem)
    return cls, options, float(weight)


def _entries(kind: str, data: Any, key: str) -> list[Spec]:
    if data is None:
        return []
    if not isinstance(data, list):
        raise ConfigError(f"{key!r} must be a list of {kind}s")
    return [_entry(kind, item, f"{key}[{i}]") for i, item in enumerate(data)]


def parse(data: Any) -> tuple[str, str, Callable[..., Profile]]:
    """(the profile's name, its help, a builder taking the router's settings) from a routing config."""
    if not isinstance(data, dict):
        raise ConfigError("the routing config must be a JSON object: a name, filters, scorers and a picker")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; the keys are: {', '.join(KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"'name' must be a lower-case identifier (letters, digits, _ or -), not {name!r}")
    if name in builtin_names():
        raise ConfigError(f"name {name!r} is a built-in policy's: choose another (or use --policy {name})")
    filters = _entries("filter", data.get("filters"), "filters")
    scorers = _entries("scorer", data.get("scorers"), "scorers")
    picker = _entry("picker", data.get("picker", "lowest"), "picker")
    help = data.get("help") or _summary(filters, scorers, picker)
    if not isinstance(help, str):
        raise ConfigError("'help' must be a string")
    _prefill(data, name)

    def build(stale_s: float = 1.0, seed: int = 0, **_: Any) -> Profile:
        env = Env(stale_s, seed)
        built_filters = [_make(env, spec) for spec in filters]
        built_scorers = [(_make(env, spec), spec[2]) for spec in scorers]
        return Profile(name, env, built_filters, built_scorers, _make(env, picker), help)  # type: ignore[arg-type]

    try:
        build()  # every plugin takes its options (a constructor may refuse a value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"profile {name!r}: {e}") from None
    return name, help, build


def register(data: Any) -> str:
    """Check a routing config and register its profile (and a prefill profile it composes); its name."""
    name, help, build = parse(data)
    prefill = _prefill(data, name)
    if prefill is not None and prefill[1] is not None:
        register_profile(prefill[0], prefill[1], prefill[2])
    register_profile(name, build, help, prefill[0] if prefill is not None else None)
    return name


def _prefill(data: dict[str, Any], name: str) -> tuple[str, Callable[..., Profile] | None, str] | None:
    """The config's ``prefill``: (a registered profile's name, None, "") or a composed one's (name, builder,
    help); None when it names none."""
    given = data.get("prefill")
    if given is None:
        return None
    if isinstance(given, str):
        if given not in available():
            raise ConfigError(f"'prefill': {given!r} is not a registered policy; use one of: "
                              f"{', '.join(available())}, or a profile object")
        return given, None, ""
    if not isinstance(given, dict) or "prefill" in given:
        raise ConfigError("'prefill' must be a registered policy's name or a profile object (without its own "
                          "'prefill')")
    pname, phelp, pbuild = parse(given)
    if pname == name:
        raise ConfigError(f"'prefill' needs a name of its own, not {name!r}")
    return pname, pbuild, phelp


def _make(env: Env, spec: Spec) -> Filter | Scorer | Picker:
    cls, options, _ = spec
    return cls(env, **options)  # type: ignore[return-value]


def _summary(filters: list[Spec], scorers: list[Spec], picker: Spec) -> str:
    parts = [f"filters {', '.join(s[0].name for s in filters) or 'none'}",
             "scorers " + (", ".join(f"{s[0].name} x {s[2]:g}" for s in scorers) or "none"),
             f"picker {picker[0].name}"]
    return "routing config: " + "; ".join(parts)
