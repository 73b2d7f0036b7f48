"""``--structured-outputs-config`` (vLLM's flag and keys): which library compiles a request's grammar.

vLLM's JSON keys and defaults; its dotted form ``--structured-outputs-config.backend NAME`` (and
``.disable_any_whitespace``, ``.disable_additional_properties``) overrides the JSON's key. ``backend``:
``xgrammar`` (what ``auto``, the default, means here), or ``guidance`` (llguidance). vLLM's ``outlines`` and
``lm-format-enforcer`` are not shipped and are refused, as are the reasoning keys (lbd has no reasoning
parser). Standard library only: the supervisor checks the flag without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

BACKENDS = ("auto", "xgrammar", "guidance")
_REFUSED_BACKENDS = ("outlines", "lm-format-enforcer")
_KEYS = ("backend", "disable_any_whitespace", "disable_additional_properties", "reasoning_parser",
         "reasoning_parser_plugin", "enable_in_reasoning")


@dataclass(slots=True, frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (xgrammar, guidance)
    disable_additional_properties: bool = False  # guidance: no additionalProperties unless the schema says

    @property
    def library(self) -> str:
        """The backend that compiles: ``auto`` is xgrammar."""
        return "xgrammar" if self.backend == "auto" else self.backend


@dataclass(slots=True, frozen=True)
class StructuredOutputsFlags:
    """The engine configuration's slice: the four flags as given (``resolve`` merges and checks them)."""

    structured_outputs_config: str | None = None
    structured_outputs_backend: str | None = None
    structured_outputs_disable_any_whitespace: bool | None = None
    structured_outputs_disable_additional_properties: bool | None = None

    def resolve(self) -> StructuredOutputsConfig:
        return parse_structured_outputs_config(self.structured_outputs_config,
                                               self.structured_outputs_backend,
                                               self.structured_outputs_disable_any_whitespace,
                                               self.structured_outputs_disable_additional_properties)


def parse_structured_outputs_config(text: str | None, backend: str | None = None,
                                    disable_any_whitespace: bool | None = None,
                                    disable_additional_properties: bool | None = None
                                    ) -> StructuredOutputsConfig:
    """The JSON flag, then the dotted flags over it; ValueError naming the flag and the fix."""
    raw = _json(text)
    for key, value in (("backend", backend), ("disable_any_whitespace", disable_any_whitespace),
                       ("disable_additional_properties", disable_additional_properties)):
        if value is not None:
            raw[key] = value
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"--structured-outputs-config: unknown keys {unknown} (vLLM's keys: {list(_KEYS)})")
    for key in ("reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning"):
        if raw.get(key):
            raise ValueError(f"--structured-outputs-config: {key} is not supported (lbd has no reasoning "
                             "parser): drop it")
    name = raw.get("backend", "auto")
    if name in _REFUSED_BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend {name!r} is not shipped with lbd: use "
                         "xgrammar (the default) or guidance")
    if name not in BACKENDS:
        raise ValueError(f"--structured-outputs-config: backend must be one of {list(BACKENDS)}, "
                         f"got {name!r}")
    cfg = StructuredOutputsConfig(name, _bool(raw, "disable_any_whitespace"),
                                  _bool(raw, "disable_additional_properties"))
    if cfg.disable_additional_properties and cfg.library != "guidance":
        raise ValueError("--structured-outputs-config: disable_additional_properties is only supported for "
                         "the guidance backend")
    return cfg


def _json(text: str | None) -> dict[str, object]:
    if not text:
        return {}
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--structured-outputs-config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--structured-outputs-config must be a JSON object, e.g. "
                         "'{\"backend\": \"xgrammar\"}'")
    return raw


def _bool(raw: dict[str, object], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"--structured-outputs-config: {key} must be true or false, got {value!r}")
    return value


def parse_bool_flag(text: str) -> bool:
    """argparse type of the dotted boolean flags: vLLM's spelling (true/false, 1/0)."""
    value = text.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")
