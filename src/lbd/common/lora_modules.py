"""``--lora-modules`` entries (vLLM's syntax), shared by the engine (adapters it serves from the start) and
the router (adapters the fleet may load on demand): each entry is one adapter, ``name=path`` or the JSON
``{"name": .., "path": .., "base_model_name": ..}``; and vLLM's gate on runtime loading. Standard library
only."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's gate on loading and unloading adapters at run time


@dataclass(slots=True, frozen=True)
class LoraModule:
    """One adapter named on the command line (or loaded at run time)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoraModule:
    """``name=path`` or vLLM's JSON form; ValueError naming the flag otherwise."""
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or \
                not isinstance(obj.get("path"), str) or not obj["name"] or not obj["path"]:
            raise ValueError('--lora-modules: the JSON form needs string "name" and "path" '
                             '(and optionally "base_model_name")')
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError('--lora-modules: "base_model_name" must be a string')
        return LoraModule(obj["name"], obj["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is neither name=path nor the JSON form "
                         '{"name": ..., "path": ...}')
    return LoraModule(name, path)


def runtime_updates_allowed(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's gate: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist only when
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is 1 or true."""
    value = (os.environ if env is None else env).get(RUNTIME_ENV, "0")
    return value.strip().lower() in ("1", "true")


def lora_module_arg(text: str) -> LoraModule:
    """``parse_lora_module`` as an argparse ``type``: a bad entry is the flag's error, with the reason."""
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--lora-modules: ")) from None
