"""Typed access to a JSON request body: each getter checks the type and range and names the field on error."""

from __future__ import annotations

from typing import Any

from lbd.engine.server.errors import APIError, bad_request

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class Fields:
    """Reads fields of one JSON object; ``prefix`` makes nested params read like ``messages[2].role``."""

    __slots__ = ("data", "prefix")

    def __init__(self, data: Any, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise bad_request(f"{prefix or 'request body'} must be a JSON object", prefix or None)
        self.data = data
        self.prefix = prefix

    def param(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str) -> Any:
        return self.data.get(name)

    def _typed(self, name: str, kind: type, default: Any) -> Any:
        value = self.data.get(name)
        if value is None:
            return default
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if not ok:
            raise bad_request(f"'{self.param(name)}' must be {_TYPE_NAMES[kind]}, got {_json_type(value)}",
                              self.param(name))
        return value

    def int(self, name: str, default: int | None = None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        """An integer in [lo, hi]; without bounds still a signed 64-bit one (what the core can carry)."""
        value = self._typed(name, int, default)
        if value is not None:
            self._range(name, value, _INT64_MIN if lo is None else lo, _INT64_MAX if hi is None else hi)
        return value

    def float(self, name: str, default: float | None = None, lo: float | None = None,
              hi: float | None = None) -> float | None:
        value = self._typed(name, float, default)
        if value is not None:
            self._range(name, value, lo, hi)
        return value

    def bool(self, name: str, default: bool | None = None) -> bool | None:
        return self._typed(name, bool, default)

    def str(self, name: str, default: str | None = None) -> str | None:
        return self._typed(name, str, default)

    def required(self, name: str) -> Any:
        if self.data.get(name) is None:
            raise bad_request(f"'{self.param(name)}' is a required field", self.param(name))
        return self.data[name]

    def str_list(self, name: str, max_items: int | None = None) -> list[str]:
        """A string or a list of strings (e.g. ``stop``)."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise bad_request(f"'{self.param(name)}' must be a string or a list of strings", self.param(name))
        if max_items is not None and len(value) > max_items:
            raise bad_request(f"'{self.param(name)}' has {len(value)} items; at most {max_items} are allowed",
                              self.param(name))
        return list(value)

    def int_list(self, name: str, lo: int | None = None, hi: int | None = None) -> list[int]:
        value = self.data.get(name)
        if value is None:
            return []
        if not is_int_list(value):
            raise bad_request(f"'{self.param(name)}' must be a list of integers", self.param(name))
        for v in value:
            self._range(name, v, lo, hi)
        return list(value)

    def obj(self, name: str) -> Fields | None:
        value = self.data.get(name)
        return None if value is None else Fields(value, self.param(name))

    def _range(self, name: str, value: float, lo: float | None, hi: float | None) -> None:
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
            raise APIError(f"'{self.param(name)}' must be {bounds}, got {value}", 400, self.param(name))


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
