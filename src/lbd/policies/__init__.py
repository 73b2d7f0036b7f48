"""Routing decisions: filters, scorers and a picker (plugins), composed into named profiles (policies).

Pure functions of (request facts, endpoint snapshots) and each plugin's explicit learned state: no I/O, no
clock reads. Importing the package registers every plugin and built-in profile; ``make_policy(name,
**options)`` builds one by name, ``lbd.policies.compose`` builds one from a routing-config file.
"""

from __future__ import annotations

from lbd.policies.base import Decision, EndpointSnapshot, Refusal, RequestFacts, queue_score
from lbd.policies.plugin import Context, Env, Filter, Learned, Picker, Scorer
from lbd.policies.prefix import CHUNK_CHARS, PrefixIndex, chunk_hashes
from lbd.policies.profile import Profile
from lbd.policies.registry import available, load, make_policy, plugin, plugins, register_profile
from lbd.policies.select import route
from lbd.policies.ttft import CHARS_PER_TOKEN

load()  # the built-in plugins and profiles (registry.MODULES)
DEFAULT_POLICY = "predicted_ttft"
Policy = Profile  # (the router's name for what it routes by)

__all__ = [
    "CHARS_PER_TOKEN",
    "CHUNK_CHARS",
    "DEFAULT_POLICY",
    "Context",
    "Decision",
    "EndpointSnapshot",
    "Env",
    "Filter",
    "Learned",
    "Picker",
    "Policy",
    "PrefixIndex",
    "Profile",
    "Refusal",
    "RequestFacts",
    "Scorer",
    "available",
    "chunk_hashes",
    "make_policy",
    "plugin",
    "plugins",
    "queue_score",
    "register_profile",
    "route",
]
