"""A rank's core process, put together: which runner (one device, or the TP/PP executor) and which loop (a
plain core, or a member of an MoE model's DP group).

This is the one place that chooses, above ``lbd.engine.core``, ``lbd.engine.executor`` and ``lbd.engine.dp``:
the core runs what it is handed and never imports the executor or the group to pick one. The launcher's core
child calls ``run``; ``python -m lbd.engine.rank_core <engine flags> --model-path DIR --input-address
ipc://...`` runs the same core alone (tests, tools). Light at import (no torch): heavy modules load once
chosen.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lbd.engine.config.args import EngineArgs, engine_args_from_namespace, make_parser, validate
from lbd.engine.core.engine_core import EngineCore, Runner, make_local_runner, needs_executor
from lbd.engine.core.process import CoreLoop, PlainCore, exit_on_worker_failure, run_core


def make_runner(args: EngineArgs, model_path: str, **executor_options: Any) -> Runner:
    """The rank's runner: the executor (worker processes) for TP x PP > 1 or Ray, else one device's."""
    if needs_executor(args):
        from lbd.engine.executor import make_executor

        return make_executor(args, model_path, **executor_options)
    return make_local_runner(args, model_path)


def build_core(args: EngineArgs, model_path: str, metrics: Any = None, **executor_options: Any) -> EngineCore:
    """An EngineCore with the runner ``make_runner`` picks (tests and tools build a TP/PP core here)."""
    runner = make_runner(args, model_path, **executor_options)
    core = EngineCore.from_args(args, model_path, metrics=metrics, runner=runner)
    if args.kv_transfer_config is not None:
        from lbd.engine.kv_transfer.connector import attach

        attach(core)
    return core


def in_dp_group(args: EngineArgs, model_path: str) -> bool:
    """Whether this rank is a member of an MoE model's DP group (read from config.json, no torch)."""
    from lbd.engine.config.parallel import ModelFacts
    from lbd.engine.dp import needs_group

    if args.data_parallel_size == 1 or args.device == "sim":
        return False
    return needs_group(args, ModelFacts.from_config(Path(model_path) / "config.json").architectures)


def core_loop(args: EngineArgs, model_path: str) -> CoreLoop:
    """The loop this rank's core process runs: a DP-group member's, or a plain core's."""
    if in_dp_group(args, model_path):
        if args.kv_transfer_config is not None:
            raise SystemExit("--kv-transfer-config is not supported on the ranks of an MoE model's DP group "
                             "(--data-parallel-size > 1): run P/D ranks as independent ranks")
        from lbd.engine.dp.rank import GroupMember

        return GroupMember(args, model_path)
    return PlainCore(args, lambda metrics: build_core(args, model_path, metrics,
                                                      on_failure=exit_on_worker_failure))


def run(args: EngineArgs, model_path: str, input_address: str) -> None:
    """Serve front ends on ``input_address`` until told to stop (``lbd.engine.core.process.run_core``)."""
    run_core(args, input_address, core_loop(args, model_path))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("python -m lbd.engine.rank_core")
    parser.add_argument("--model-path", required=True, help="local model folder (config.json + safetensors)")
    parser.add_argument("--input-address", required=True, help="ZMQ address to bind, e.g. ipc:///tmp/core.sock")
    ns = parser.parse_args(argv)
    args = engine_args_from_namespace(ns)
    validate(args, parser)
    run(args, ns.model_path, ns.input_address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
