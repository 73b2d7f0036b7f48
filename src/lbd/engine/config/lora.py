"""LoRA flags (vLLM's names): ``--enable-lora``, ``--max-loras``, ``--max-lora-rank``, ``--max-cpu-loras`` and
``--lora-modules``, as the engine configuration's ``lora`` slice, plus their checks.

``--lora-modules`` takes vLLM's two forms, each one adapter: ``name=path`` or the JSON
``{"name": .., "path": .., "base_model_name": ..}``. Standard library only (the supervisor validates engine
flags without torch); the entries' syntax is ``lbd.common.lora_modules`` (the router reads it too); reading
an adapter's files is ``lbd.engine.lora.peft``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lbd.common.lora_modules import LoraModule, parse_lora_module

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices for --max-lora-rank


@dataclass(slots=True, frozen=True)
class LoraFlags:
    """The engine configuration's slice: the flags as given."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] | None = None  # as given; ``modules`` parses them

    @property
    def modules(self) -> list[LoraModule]:
        return [parse_lora_module(m) for m in self.lora_modules or []]

    @property
    def cpu_slots(self) -> int:
        """Adapters kept loaded in host memory: ``--max-cpu-loras`` (vLLM's default: ``--max-loras``)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", default=False,
                   help="serve LoRA adapters (PEFT folders) next to the base model, mixed in one batch")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident on the device at once (slots, least recently used evicted)")
    g.add_argument("--max-lora-rank", type=int, default=16, help=f"largest adapter rank: one of "
                   f"{', '.join(map(str, MAX_LORA_RANKS))}")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory behind the slots (default: --max-loras)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters served from the start: name=path or \'{"name": .., "path": .., '
                        '"base_model_name": ..}\'')


def lora_flags(args: object) -> LoraFlags:
    """The slice from an ``EngineArgs`` (``validate`` has checked it)."""
    return LoraFlags(bool(getattr(args, "enable_lora", False)), getattr(args, "max_loras", 1),
                     getattr(args, "max_lora_rank", 16), getattr(args, "max_cpu_loras", None),
                     getattr(args, "lora_modules", None))


def lora_flags_problem(args: object) -> str | None:
    """What is wrong with the LoRA flags on their own, or None."""
    flags = lora_flags(args)
    try:
        modules = flags.modules
    except ValueError as e:
        return str(e)
    if modules and not flags.enable_lora:
        return "--lora-modules needs --enable-lora"
    if flags.max_loras < 1:
        return f"--max-loras must be a positive number, got {flags.max_loras}"
    if flags.max_lora_rank not in MAX_LORA_RANKS:
        choices = ", ".join(map(str, MAX_LORA_RANKS))
        return f"--max-lora-rank must be one of {choices}, got {flags.max_lora_rank}"
    if flags.max_cpu_loras is not None and flags.max_cpu_loras < flags.max_loras:
        return (f"--max-cpu-loras ({flags.max_cpu_loras}) must be >= --max-loras ({flags.max_loras}): every "
                "adapter on the device is also kept in host memory")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        return "--lora-modules: each adapter name may appear once"
    if not flags.enable_lora:
        return None
    if getattr(args, "pipeline_parallel_size", 1) > 1:
        return ("--enable-lora runs on one pipeline stage per rank: LoRA under pipeline parallelism is not "
                "supported yet (drop --pipeline-parallel-size or --enable-lora; tensor parallelism works)")
    return None  # (--device sim models slots and load time: lbd.engine.core.sim_lora)
