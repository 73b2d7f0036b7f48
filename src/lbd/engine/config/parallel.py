"""Start-up checks of the TP/PP flags against the model and the devices: one line, exit 2, nothing started.

``lbd serve`` / ``python -m lbd.engine`` run them after the model is resolved (its config.json is on disk) and
before any process or port; ``lbd supervise`` runs them before binding its health port, reading config.json
of an HF folder or of a GGUF file's converted copy in the cache (a GGUF never converted yet is checked by the
rank itself, which then exits 2 before binding its port, and the supervisor exits 2 too). Only json and the
standard library are imported here: the supervisor stays light.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lbd.engine.config.args import EngineArgs


class ParallelConfigError(ValueError):
    """A TP/PP flag that cannot work with this model or machine; the message is one line with the fix."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The numbers of a checkpoint that decide which TP/PP sizes can work."""

    architectures: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    num_layers: int
    intermediate_size: int | None
    moe_intermediate_size: int | None = None  # per routed expert (MoE models)

    @property
    def name(self) -> str:
        return self.architectures[0] if self.architectures else "(no architecture in config.json)"

    def describe(self) -> str:
        return (f"{self.name}: {self.num_heads} attention heads, {self.num_kv_heads} KV heads, "
                f"{self.num_layers} layers")

    @classmethod
    def from_config(cls, path: Path) -> ModelFacts:
        raw = json.loads(path.read_text())
        archs = tuple(raw.get("architectures") or ())
        text = raw.get("text_config") or raw  # multimodal wrappers keep the decoder's numbers inside
        heads = int(text.get("num_attention_heads") or 1)
        moe_width = text.get("moe_intermediate_size")
        if moe_width is None and "MixtralForCausalLM" in archs:
            moe_width = text.get("intermediate_size")  # Mixtral's experts are intermediate_size wide
        return cls(archs, heads, int(text.get("num_key_value_heads") or heads),
                   int(text.get("num_hidden_layers") or 1), text.get("intermediate_size"), moe_width)


def model_facts(model: str | None) -> ModelFacts | None:
    """Facts of ``--model`` read without torch, or None when that would need a GGUF conversion first (or the
    model is missing: the engine reports that itself)."""
    try:
        config = config_path(model)
        return ModelFacts.from_config(config) if config is not None else None
    except (OSError, KeyError, ValueError, TypeError):
        return None


def config_path(model: str | None) -> Path | None:
    """config.json of ``--model`` (an HF folder, or a GGUF's converted copy in the cache), without torch;
    None when there is none yet (a GGUF not converted) or the model is missing."""
    from lbd.engine.config.model_files import ModelNotFoundError, converted_path, default_gguf

    try:
        path = Path(model).expanduser() if model is not None else default_gguf()
        if path.is_dir() and (path / "config.json").is_file():
            return path / "config.json"
        gguf = path if path.is_file() else next(iter(sorted(path.glob("*.gguf"))), None)
        config = converted_path(gguf) / "config.json" if gguf is not None else None
    except (ModelNotFoundError, OSError):
        return None
    return config if config is not None and config.is_file() else None


def _good_tp_sizes(facts: ModelFacts) -> list[int]:
    return [t for t in range(1, facts.num_heads + 1) if _tp_problem(facts, t) is None]


def _tp_problem(facts: ModelFacts, tp: int) -> str | None:
    heads, kv = facts.num_heads, facts.num_kv_heads
    if heads % tp:
        return f"does not divide the model's {heads} attention heads"
    if kv % tp and tp % kv:
        return f"neither divides the model's {kv} KV heads nor is a multiple of them"
    if facts.intermediate_size and facts.intermediate_size % tp:
        return f"does not divide the model's MLP width {facts.intermediate_size}"
    return None


def _sizes(values: list[int]) -> str:
    text = ", ".join(map(str, values[:-1]))
    return f"{text} or {values[-1]}" if text else str(values[-1])


def check_model(tp: int, pp: int, partition: list[int] | None, facts: ModelFacts,
                kv_cache_dtype: str = "auto") -> None:
    """Whether the architecture supports TP/PP (and the KV-cache dtype) at all (``lbd.engine.models``, the one
    place that decides it), then TP against the heads (and KV heads, MLP width), PP and
    --pp-layer-partition against the layers. Raises ParallelConfigError."""
    from types import SimpleNamespace

    from lbd.engine.config.architectures import unsupported_flags

    problem = unsupported_flags(SimpleNamespace(architectures=list(facts.architectures)), tp, pp,
                                kv_cache_dtype)
    if problem:
        raise ParallelConfigError(problem)
    if tp > 1 and (problem := _tp_problem(facts, tp)):
        raise ParallelConfigError(f"--tensor-parallel-size {tp} {problem} ({facts.describe()}): use "
                                  f"--tensor-parallel-size {_sizes(_good_tp_sizes(facts))}")
    if pp > facts.num_layers:
        raise ParallelConfigError(f"--pipeline-parallel-size {pp} exceeds the model's {facts.num_layers} "
                                  f"layers ({facts.describe()}): use at most {facts.num_layers} stages")
    if partition is not None and sum(partition) != facts.num_layers:
        raise ParallelConfigError(
            f"--pp-layer-partition {','.join(map(str, partition))} sums to {sum(partition)} layers but the "
            f"model has {facts.num_layers} ({facts.describe()}): give {pp} counts that sum to "
            f"{facts.num_layers}")


def check_devices(tp: int, pp: int, cuda_devices: list[str] | None, visible_text: str,
                  cpus: int) -> str | None:
    """TP x PP workers against the rank's devices: raises when CUDA devices are short; returns a warning
    when CPU workers outnumber the rank's CPUs (allowed: oversubscribed, correct, slower)."""
    world = tp * pp
    if cuda_devices is not None and world > len(cuda_devices):
        raise ParallelConfigError(
            f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} needs {world} CUDA devices but "
            f"{len(cuda_devices)} are visible (CUDA_VISIBLE_DEVICES={visible_text}): lower the sizes, expose "
            "more devices, or pass --device cpu")
    if cuda_devices is None and world > cpus:
        return (f"{world} TP x PP workers share {cpus} CPU(s): oversubscribed, so steps are slower than with "
                "fewer workers (allowed on the CPU)")
    return None


def check_rank(args: EngineArgs, facts: ModelFacts | None, env: dict[str, str]) -> str | None:
    """Every model-dependent check of one rank's command line (``lbd serve``): the architecture against
    TP/PP and the KV-cache dtype, the TP/PP sizes against the model and the devices. Raises
    ParallelConfigError, returns a warning to log (CPU oversubscription) or None. ``facts`` None: the model
    is checked by the rank later.

    The devices are the rank's own: TP x PP of them (``lbd supervise`` checks data-parallel-size-local x TP x
    PP against the node's, and hands each rank its slice)."""
    from lbd.engine.config.layout import parse_partition
    from lbd.engine.config.placement import rank_threads, visible_cuda_devices

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if facts is not None and args.device != "sim":
        check_model(tp, pp, parse_partition(args.pp_layer_partition), facts, args.kv_cache_dtype)
    if facts is not None:
        check_dp_group(args, facts)
    if tp * pp == 1 or args.distributed_executor_backend == "ray":  # Ray finds the devices, on any node
        return None
    cuda = visible_cuda_devices(env, args.device)
    cpus = rank_threads(args.data_parallel_size_local, args.data_parallel_size, env)
    return check_devices(tp, pp, cuda, env.get("CUDA_VISIBLE_DEVICES", "<unset>"), cpus)


# the MoE-only flags' defaults (lbd.engine.config.args): a dense model refuses anything else
MOE_ONLY_DEFAULTS = {"--all2all-backend": "auto", "--dp-idle-check-steps": 32}


def dense_model_flags_problem(all2all_backend: str, dp_idle_check_steps: int, name: str) -> str | None:
    """An MoE-only flag set on a dense model, where it has no effect (no experts to move tokens to, no DP
    group whose waves end): the refusal, naming the flag and the fix; None when both are at their defaults."""
    given = {"--all2all-backend": all2all_backend, "--dp-idle-check-steps": dp_idle_check_steps}
    for flag, value in given.items():
        if value != MOE_ONLY_DEFAULTS[flag]:
            return (f"{flag} {value}: {name} is a dense model (no experts, no MoE DP group), so it would do "
                    "nothing: drop the flag")
    return None


def check_dp_group(args: EngineArgs, facts: ModelFacts) -> None:
    """The MoE DP-group flags against the model: a dense model has no group (and no experts to spread); an
    MoE model served by N > 1 ranks needs the group's address; tensor-parallel experts must split evenly."""
    from lbd.engine.config.architectures import is_moe

    moe = is_moe(facts.architectures)
    grouped = args.data_parallel_address is not None
    if not moe:
        problem = dense_model_flags_problem(args.all2all_backend, args.dp_idle_check_steps, facts.name)
        if problem:
            raise ParallelConfigError(problem)
        if args.enable_expert_parallel:
            raise ParallelConfigError(
                f"--enable-expert-parallel: {facts.name} is a dense model (no experts): drop the flag")
        if grouped:
            raise ParallelConfigError(
                f"--data-parallel-address / --data-parallel-rpc-port: {facts.name} is a dense model, whose "
                "DP ranks are independent (no group, no coordinator): drop both flags")
        return
    if args.data_parallel_size > 1 and not grouped and args.data_parallel_rank is not None:
        raise ParallelConfigError(
            f"{facts.name} is an MoE model: its {args.data_parallel_size} DP ranks share the expert layers, "
            f"so rank {args.data_parallel_rank} needs the group's --data-parallel-address and "
            "--data-parallel-rpc-port (the coordinator: python -m lbd.engine.dp.coordinator)")
    if grouped and args.distributed_executor_backend == "ray":
        raise ParallelConfigError(
            f"--distributed-executor-backend ray: a rank of {facts.name}'s DP group runs its model in the "
            "core process (one member per rank, TP x PP = 1): use mp (the default)")
    width = facts.moe_intermediate_size
    n = args.data_parallel_size
    if grouped and not args.enable_expert_parallel and width and width % n:
        raise ParallelConfigError(
            f"tensor-parallel experts: {facts.name}'s expert width {width} does not split into "
            f"--data-parallel-size {n} slices: pass --enable-expert-parallel (any expert count works)")
