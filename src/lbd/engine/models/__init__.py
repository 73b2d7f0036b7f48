"""Model implementations over paged attention, chosen by ``config.architectures``.

Tensor/pipeline parallelism: a model class that handles it declares ``supports_parallel = True`` and takes a
``parallel`` keyword (an ``lbd.engine.distributed.context.ParallelContext``: its TP slice and pipeline stage);
every other class is refused with TP or PP > 1, by ``lbd.engine.config.architectures.unsupported_flags``, the
one place that decides it from names alone (the launcher and the supervisor call it before anything starts).
The names there say what the classes declare; tests/engine/models/test_weights.py keeps them in agreement.
"""

from __future__ import annotations

from typing import Any

from lbd.engine.config.architectures import ARCHITECTURES, unsupported_flags


def model_class(hf_config: Any) -> type:
    """The class serving ``config.architectures`` (imports torch); ValueError naming the supported ones."""
    import importlib

    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            module, cls_name, _ = ARCHITECTURES[arch]
            return getattr(importlib.import_module(module), cls_name)
    raise ValueError(f"unsupported architecture {archs or '(none in config.json)'}: "
                     f"supported are {sorted(ARCHITECTURES)}")


def build_model(hf_config: Any, max_positions: int, parallel: Any = None, **options: Any):
    """Our model for a transformers config, with uninitialised weights on the current default device.

    ``parallel`` (a ParallelContext spanning more than one worker) makes it this worker's shard: its TP
    slice of every layer, and only its pipeline stage's layers. ``options`` go to classes with
    ``from_hf_config`` (e.g. ``expert_shard`` for MoE models)."""
    from lbd.engine.models.config import arch_config

    cls = model_class(hf_config)
    sharded = parallel is not None and parallel.layout.world_size > 1
    if sharded:
        problem = unsupported_flags(hf_config, parallel.tp_size, parallel.pp_size, "auto")
        if problem or not getattr(cls, "supports_parallel", False):
            raise ValueError(problem or f"{cls.__name__} does not support tensor or pipeline parallelism")
        options["parallel"] = parallel
    if hasattr(cls, "from_hf_config"):
        return cls.from_hf_config(hf_config, max_positions, **options)
    extra = set(options) - {"parallel"}
    if extra:
        raise ValueError(f"{cls.__name__} takes no model options, got {sorted(extra)}")
    qkv_bias = next(ARCHITECTURES[a][2] for a in hf_config.architectures if a in ARCHITECTURES)
    return cls(arch_config(hf_config, qkv_bias=qkv_bias), max_positions, **options)
