"""PEFT LoRA folders: ``adapter_config.json`` and ``adapter_model.safetensors``, checked before any weight is
used, so a bad adapter gets a 400 that says why and nothing else is affected.

Supported: plain LoRA (``peft_type`` LORA) on the attention and MLP projections of a dense decoder (q/k/v/o,
gate/up/down), every layer, rank at most ``--max-lora-rank``, scaling ``lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with ``use_rslora``). Refused: other target modules (embeddings, the LM head),
DoRA, ``modules_to_save``, trained biases, per-module rank/alpha patterns, ``layers_to_transform`` and
``fan_in_fan_out``. Tensor names are PEFT's: ``base_model.model.<module path>.lora_A.weight`` [r, in] and
``.lora_B.weight`` [out, r].
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")

ModuleShapes = dict[str, tuple[int, int]]  # projection name -> (in_features, out_features) of the base model


class AdapterError(Exception):
    """An adapter that cannot be served; ``status`` is the HTTP status (404 missing folder, 400 refused)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(slots=True, frozen=True)
class AdapterSpec:
    """What ``adapter_config.json`` says, checked."""

    rank: int
    scaling: float
    target_modules: tuple[str, ...]


@dataclass(slots=True)
class AdapterWeights:
    """An adapter in host memory: per (layer, projection) A [r, in] and B [out, r], scaling folded in B."""

    spec: AdapterSpec
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    nbytes: int


def _targets(raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):  # PEFT's regex form: the supported names it matches
        found = tuple(m for m in SUPPORTED_MODULES if re.search(raw, f"model.layers.0.x.{m}"))
        if not found:
            raise AdapterError(f"adapter target_modules {raw!r} matches none of "
                               f"{', '.join(SUPPORTED_MODULES)}")
        return found
    if not isinstance(raw, list) or not raw or not all(isinstance(m, str) for m in raw):
        raise AdapterError("adapter_config.json: target_modules must be a non-empty list of module "
                           "names")
    names = tuple(m.rsplit(".", 1)[-1] for m in raw)
    other = sorted(set(names) - set(SUPPORTED_MODULES))
    if other:
        raise AdapterError(f"adapter targets {', '.join(other)}: only the attention and MLP projections "
                           f"({', '.join(SUPPORTED_MODULES)}) are supported")
    return tuple(dict.fromkeys(names))


def _refusal(cfg: dict) -> str | None:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} is not supported: only LORA"
    if cfg.get("use_dora"):
        return "DoRA adapters (use_dora) are not supported"
    if cfg.get("modules_to_save"):
        return "adapters with modules_to_save (fully trained modules) are not supported"
    if cfg.get("bias", "none") not in ("none", None):
        return f"adapters with trained biases (bias={cfg.get('bias')!r}) are not supported"
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        return "per-module rank_pattern/alpha_pattern is not supported"
    if cfg.get("layers_to_transform") is not None or cfg.get("fan_in_fan_out"):
        return "layers_to_transform and fan_in_fan_out are not supported"
    return None


def read_spec(path: str | Path, max_rank: int) -> AdapterSpec:
    """The checked config of the adapter folder ``path``; AdapterError (404 or 400) otherwise."""
    folder = Path(path)
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise AdapterError(f"No adapter found at {str(path)!r}: {CONFIG_FILE} is missing", 404)
    if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    problem = _refusal(cfg)
    if problem:
        raise AdapterError(problem)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter rank r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter rank {rank} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(rank, float(scaling), _targets(cfg.get("target_modules")))


def load_weights(path: str | Path, spec: AdapterSpec, shapes: ModuleShapes, num_layers: int,
                 dtype: torch.dtype) -> AdapterWeights:
    """Read and check every tensor (names, shapes, all layers present); AdapterError otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise AdapterError(f"No adapter weights at {str(path)!r}: {WEIGHTS_FILE} is missing", 404)
    try:
        raw = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in raw.items():
        m = _KEY.match(name)
        if m is None or m.group(3) not in spec.target_modules or int(m.group(1)) >= num_layers:
            raise AdapterError(f"unexpected tensor {name!r} in {WEIGHTS_FILE} (only lora_A/lora_B of "
                               f"{', '.join(spec.target_modules)} in layers 0..{num_layers - 1})")
        parts.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    tensors = {}
    for layer in range(num_layers):
        for module in spec.target_modules:
            ab = parts.get((layer, module), {})
            if set(ab) != {"A", "B"}:
                raise AdapterError(f"{WEIGHTS_FILE} lacks lora_A/lora_B of layer {layer} {module}")
            a, b = ab["A"], ab["B"]
            fan_in, fan_out = shapes[module]
            if tuple(a.shape) != (spec.rank, fan_in) or tuple(b.shape) != (fan_out, spec.rank):
                raise AdapterError(f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                                   f"{tuple(b.shape)} "
                                   f"do not fit the model (expected ({spec.rank}, {fan_in}) / "
                                   f"({fan_out}, {spec.rank}))")
            tensors[(layer, module)] = (a.to(dtype), (b.float() * spec.scaling).to(dtype))
    nbytes = sum(a.nbytes + b.nbytes for a, b in tensors.values())
    return AdapterWeights(spec, tensors, nbytes)
