"""Parallelism flags: every invalid combination exits 2 with one line naming the flag, the model's numbers
and a fix, in ``lbd serve`` and in ``lbd supervise``, before anything starts; and every parallelism / DP flag
of either command's ``--help`` either changes what would run (worker processes, placement, groups, ranks) or
is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lbd.common.ports import port_in_use
from lbd.engine.config.args import EngineArgs, engine_args_from_namespace, make_parser
from lbd.engine.config.placement import rank_threads
from lbd.engine.config.slices import parallel_config
from lbd.engine.executor.mp import worker_config
from lbd.engine.executor.plan import plan_workers
from lbd.supervisor.config import parse_args
from support import free_port_run


def _config_only(path: Path, arch: str, heads: int, kv: int, hidden: int, inter: int,
                 layers: int = 2) -> Path:
    """A checkpoint folder whose config.json is all the checks read (the weights file is never opened)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": layers,
        "vocab_size": 256, "max_position_embeddings": 512}))
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def models(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("flag-models")
    return {"tiny": tiny_llama,  # 4 heads, 2 KV heads, 2 layers, MLP 128
            "kv4": _config_only(base / "kv4", "LlamaForCausalLM", 12, 4, 96, 192),
            "mlp100": _config_only(base / "mlp100", "LlamaForCausalLM", 8, 8, 64, 100),
            "mixtral": _config_only(base / "mixtral", "MixtralForCausalLM", 4, 2, 64, 128)}


DP_RANK0 = ["--data-parallel-size", "2", "--data-parallel-rank", "0"]
GROUP_AT = ["--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "13345"]

# (case, model, flags, needles) -- checked by both commands
CASES = [
    ("tp-vs-heads", "tiny", ["--tensor-parallel-size", "3"],
     ["--tensor-parallel-size 3", "4 attention heads", "use --tensor-parallel-size 1, 2 or 4"]),
    ("tp-vs-kv-heads", "kv4", ["--tensor-parallel-size", "6"],
     ["--tensor-parallel-size 6", "4 KV heads", "use --tensor-parallel-size 1, 2, 4 or 12"]),
    ("tp-vs-mlp", "mlp100", ["--tensor-parallel-size", "8"], ["--tensor-parallel-size 8", "MLP width 100"]),
    ("pp-vs-layers", "tiny", ["--pipeline-parallel-size", "3"],
     ["--pipeline-parallel-size 3", "2 layers", "at most 2"]),
    ("partition-sum", "tiny", ["--pipeline-parallel-size", "2", "--pp-layer-partition", "1,2"],
     ["--pp-layer-partition 1,2", "sums to 3", "has 2"]),
    ("partition-length", "tiny", ["--pipeline-parallel-size", "2", "--pp-layer-partition", "2"],
     ["--pp-layer-partition 2", "2 positive layer counts"]),
    ("partition-zero", "tiny", ["--pipeline-parallel-size", "2", "--pp-layer-partition", "0,2"],
     ["--pp-layer-partition 0,2", "2 positive layer counts"]),
    ("partition-text", "tiny", ["--pipeline-parallel-size", "2", "--pp-layer-partition", "one,one"],
     ["--pp-layer-partition", "comma-separated"]),
    ("architecture", "mixtral", ["--tensor-parallel-size", "2"],
     ["--tensor-parallel-size 2", "MixtralForCausalLM does not support", "pass 1 for both"]),
    ("cuda-devices", "tiny", ["--device", "cuda", "--tensor-parallel-size", "2"],
     ["--tensor-parallel-size 2", "needs 2 CUDA devices", "1 are visible"]),
    ("ray-executor-sim", "tiny", ["--device", "sim", "--distributed-executor-backend", "ray"],
     ["--distributed-executor-backend ray places real devices", "--device cpu"]),
    ("expert-parallel", "tiny", ["--enable-expert-parallel"], ["--enable-expert-parallel", "dense"]),
    ("all2all-dense", "tiny", ["--all2all-backend", "allgather_reducescatter"],
     ["--all2all-backend allgather_reducescatter", "dense model", "drop the flag"]),
    ("idle-check-dense", "tiny", ["--dp-idle-check-steps", "8"],
     ["--dp-idle-check-steps 8", "dense model", "drop the flag"]),
    ("timeout", "tiny", ["--distributed-timeout-s", "0"], ["--distributed-timeout-s must be > 0"]),
    ("sim-device", "tiny", ["--device", "sim", "--pipeline-parallel-size", "2"],
     ["--device sim simulates one device"]),
    ("mixed-prefill-zero", "tiny", ["--max-prefill-tokens-with-decodes", "0"],
     ["--max-prefill-tokens-with-decodes must be a positive"]),
    ("mixed-prefill-above-budget", "tiny",
     ["--max-num-batched-tokens", "256", "--max-prefill-tokens-with-decodes", "512"],
     ["--max-prefill-tokens-with-decodes 512 is above --max-num-batched-tokens 256"]),
]
SERVE_ONLY = [
    ("dp-size-without-rank", "tiny", ["--data-parallel-size", "2"],
     ["--data-parallel-size 2 without --data-parallel-rank", "lbd supervise"]),
    ("start-rank", "tiny", ["--data-parallel-start-rank", "0"],
     ["--data-parallel-start-rank", "lbd supervise"]),
    # one rank of an MoE DP group (lbd.engine.dp)
    ("dp-address-alone", "tiny", ["--data-parallel-address", "10.0.0.1"],
     ["--data-parallel-address needs --data-parallel-rpc-port"]),
    ("dp-rpc-port-alone", "tiny", ["--data-parallel-rpc-port", "13345"],
     ["--data-parallel-rpc-port needs --data-parallel-address"]),
    ("dp-group-dense", "tiny", [*DP_RANK0, *GROUP_AT], ["LlamaForCausalLM is a dense model", "independent"]),
    ("dp-group-size-1", "mixtral", GROUP_AT, ["--data-parallel-size is 1"]),
    ("moe-rank-without-group", "mixtral", DP_RANK0, ["MoE model", "--data-parallel-address"]),
    ("alltoall-without-ep", "mixtral", ["--all2all-backend", "alltoall"],
     ["needs --enable-expert-parallel"]),
    ("tp-experts-width", "mixtral", ["--data-parallel-size", "3", "--data-parallel-rank", "0", *GROUP_AT],
     ["expert width 128", "--data-parallel-size 3", "--enable-expert-parallel"]),
    ("idle-check-steps", "tiny", ["--dp-idle-check-steps", "0"],
     ["--dp-idle-check-steps must be a positive"]),
    ("dp-group-ray-executor", "mixtral", [*DP_RANK0, *GROUP_AT, "--distributed-executor-backend", "ray"],
     ["--distributed-executor-backend ray", "use mp"]),
    ("dp-group-sim", "mixtral", ["--device", "sim", *DP_RANK0, *GROUP_AT], ["--device sim", "--device cpu"]),
]


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env={**full, **env},
                          timeout=120)


def _refused(proc: subprocess.CompletedProcess[str], prog: str, needles: list[str], ports: list[int]) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in last, last
    assert "EngineCore" not in proc.stderr and "[rank" not in proc.stderr + proc.stdout  # nothing started
    for port in ports:
        assert port_in_use("127.0.0.1", port) is None, f"port {port} left bound"


@pytest.mark.parametrize(("case", "model", "flags", "needles"), CASES + SERVE_ONLY,
                         ids=[c[0] for c in CASES + SERVE_ONLY])
def test_serve_refuses(case: str, model: str, flags: list[str], needles: list[str],
                       models: dict[str, Path]) -> None:
    port = free_port_run(1)
    proc = _run(["-m", "lbd.engine", "--model", str(models[model]), "--host", "127.0.0.1",
                 "--port", str(port),
                 *flags], env={"CUDA_VISIBLE_DEVICES": "0"} if case == "cuda-devices" else {})
    _refused(proc, "lbd serve", needles, [port])


@pytest.mark.parametrize(("case", "model", "flags", "needles"), CASES, ids=[c[0] for c in CASES])
def test_supervise_refuses(case: str, model: str, flags: list[str], needles: list[str],
                           models: dict[str, Path]) -> None:
    base = free_port_run(3)
    proc = _run(["-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
                 "--data-parallel-size", "1", "--model", str(models[model]), "--host", "127.0.0.1",
                 "--port", str(base), "--supervisor-host", "127.0.0.1",
                 "--data-parallel-supervisor-port", str(base + 2), *flags],
                env={"CUDA_VISIBLE_DEVICES": "0"} if case == "cuda-devices" else {})
    _refused(proc, "lbd supervise", needles, [base, base + 2])


# ---- the flag walk ---------------------------------------------------------------------------------------


def _plans(*argv: str, layers: int) -> list:
    """The worker plans of one engine rank started with ``argv``."""
    return plan_workers(parallel_config(_serve(*argv)), layers)


def _serve(*argv: str) -> EngineArgs:
    """One engine rank's arguments (python -m lbd.engine, or lbd serve with --data-parallel-rank)."""
    return engine_args_from_namespace(make_parser().parse_args(list(argv)))


def _supervise(*argv: str, env: dict[str, str] | None = None):  # noqa: ANN202 (a SupervisorConfig)
    base = free_port_run(5)
    return parse_args(["--host", "127.0.0.1", "--port", str(base), "--supervisor-host", "127.0.0.1",
                       "--data-parallel-supervisor-port", str(base + 4), "--device", "cpu", *argv],
                      env=env or {})


def _deploy(*argv: str):  # noqa: ANN202 (an lbd.serve Plan)
    from lbd.serve.plan import parse

    base = free_port_run(8)
    return parse(["--host", "127.0.0.1", "--port", str(base), "--data-parallel-supervisor-port",
                  str(base + 7), "--device", "cpu", *argv], env={})


HEADLESS = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--headless",
            "--data-parallel-address", "127.0.0.1"]


def _exit_2(*parses: Callable[[], object]) -> None:
    for parse in parses:
        with pytest.raises(SystemExit) as e:
            parse()
        assert e.value.code == 2


def _one_rank(*argv: str) -> Callable[[], None]:
    def check() -> None:
        from lbd.engine.config.args import validate

        parser = make_parser()
        validate(engine_args_from_namespace(parser.parse_args(list(argv))), parser)
    return check


def _walk_tensor_parallel(model: Path) -> None:
    assert len(_plans("--tensor-parallel-size", "2", layers=2)) == 2  # two worker processes
    cuda = _supervise("--model", str(model), "--device", "cuda", "--data-parallel-size", "2",
                      "--tensor-parallel-size", "2", env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert [r.devices for r in cuda.ranks] == ["0,1", "2,3"]  # each rank gets TP devices


def _walk_pipeline_parallel(model: Path) -> None:
    plans = _plans("--pipeline-parallel-size", "2", layers=4)
    assert [p.layers for p in plans] == [(0, 2), (2, 4)]  # two stages, two processes


def _walk_partition(model: Path) -> None:
    plans = _plans("--pipeline-parallel-size", "2", "--pp-layer-partition", "1,3", layers=4)
    assert [p.layers for p in plans] == [(0, 1), (1, 4)]


def _walk_executor_backend(model: Path) -> None:
    from lbd.engine.executor import executor_class

    assert executor_class(_serve()).__name__ == "MultiprocExecutor"  # processes on this node
    ray_rank = _serve("--distributed-executor-backend", "ray", "--tensor-parallel-size", "2")
    assert executor_class(ray_rank).__name__ == "RayExecutor"  # Ray actors in a placement group
    tp2 = ["--model", str(model), "--distributed-executor-backend", "ray", "--tensor-parallel-size", "2"]
    cfg = _supervise(*tp2)
    assert "--distributed-executor-backend=ray" in cfg.ranks[0].argv  # every rank runs its workers so
    assert cfg.executor_backend == "ray"  # and Ray-placed ranks hand their placement group over to them
    cuda = _supervise(*tp2, "--device", "cuda", "--data-parallel-size", "2",
                      env={"CUDA_VISIBLE_DEVICES": "0"})
    assert [r.devices for r in cuda.ranks] == [None, None]  # Ray gives the workers their GPUs, on any node
    _exit_2(_one_rank("--distributed-executor-backend", "ray", "--device", "sim"))


def _walk_timeout(model: Path) -> None:
    config = worker_config(_serve("--distributed-timeout-s", "7"), str(model), ("127.0.0.1", 1))
    assert config["timeout_s"] == 7.0  # every collective and the rendezvous of the group


def _moe_rank(*argv: str) -> EngineArgs:
    return _serve("--data-parallel-size", "2", "--data-parallel-rank", "1", "--data-parallel-address",
                  "127.0.0.1", "--data-parallel-rpc-port", "29900", *argv)


def _walk_expert_parallel(model: Path) -> None:
    from lbd.engine.dp.expert_parallel import ExpertPlan

    _exit_2(lambda: _supervise("--enable-expert-parallel"),
             lambda: _deploy("--data-parallel-size", "2", "--enable-expert-parallel"))  # a dense model
    # an MoE rank: a slice of the experts (rank 1 of 2: experts 4..7 of 8), else a slice of every expert
    ep, tp = ExpertPlan.from_args(_moe_rank("--enable-expert-parallel")), ExpertPlan.from_args(_moe_rank())
    assert (ep.shard(8).start, ep.shard(8).stop, ep.shard(8).tp_size) == (4, 8, 1)
    assert (tp.shard(8).num_local, tp.shard(8).tp_rank, tp.shard(8).tp_size) == (8, 1, 2)


def _walk_address(model: Path) -> None:
    from lbd.engine.dp import endpoints

    plan = _deploy(*HEADLESS)
    assert plan.address == "127.0.0.1" and plan.member  # this node registers its ranks there
    _exit_2(lambda: _supervise("--data-parallel-address", "10.0.0.1"),
             _one_rank("--data-parallel-address", "10.0.0.1"))
    assert endpoints(_moe_rank()) == ("127.0.0.1", 29901, "tcp://127.0.0.1:29902")  # the MoE group


def _walk_rpc_port(model: Path) -> None:
    from lbd.engine.dp import endpoints

    assert _deploy(*HEADLESS, "--data-parallel-rpc-port", "29999").rpc_port == 29999
    _exit_2(lambda: _supervise("--data-parallel-rpc-port", "29999"),
             _one_rank("--data-parallel-rpc-port", "29999"))
    assert endpoints(_moe_rank())[1:] == (29901, "tcp://127.0.0.1:29902")


def _walk_all2all_backend(model: Path) -> None:
    from lbd.engine.dp.expert_parallel import ExpertDispatcher, ExpertPlan

    _exit_2(_one_rank("--all2all-backend", "alltoall"))  # without --enable-expert-parallel
    _dense_refuses(model, "--all2all-backend", "allgather_reducescatter")
    def all_to_all(*argv: str) -> bool:
        plan = ExpertPlan.from_args(_moe_rank(*argv))
        return ExpertDispatcher(plan, plan.shard(8), torch.device("cpu")).uses_all_to_all

    assert all_to_all("--enable-expert-parallel")  # auto: all-to-all with expert parallelism
    assert not all_to_all("--enable-expert-parallel", "--all2all-backend", "allgather_reducescatter")
    assert not all_to_all()  # tensor-parallel experts always gather


def _dense_refuses(model: Path, *flags: str) -> None:
    """An MoE-only flag on a dense model: refused by one rank, lbd supervise and an lbd serve deployment."""
    from lbd.engine.config.parallel import ParallelConfigError, check_rank, model_facts

    with pytest.raises(ParallelConfigError, match=flags[0]):
        check_rank(_serve("--model", str(model), *flags), model_facts(str(model)), {})
    _exit_2(lambda: _supervise("--model", str(model), *flags),
             lambda: _deploy("--model", str(model), "--data-parallel-size", "2", *flags))


def _walk_idle_check_steps(model: Path) -> None:
    from lbd.engine.dp.wave import Wave

    _exit_2(_one_rank("--dp-idle-check-steps", "0"))
    _dense_refuses(model, "--dp-idle-check-steps", "8")
    wave = Wave(_moe_rank("--dp-idle-check-steps", "3").dp_idle_check_steps)
    wave.start()
    assert [wave.stepped(dummy=False) for _ in range(6)] == [False, False, True] * 2  # all-reduce each 3rd


def _walk_dp_rank(model: Path) -> None:
    # one rank: the rank it serves as (metrics' engine label, the X-data-parallel-rank it answers)
    assert _serve("--data-parallel-rank", "1", "--data-parallel-size", "2").rank == 1
    _exit_2(lambda: _supervise("--data-parallel-rank", "1"))  # lbd supervise assigns ranks itself


def _walk_dp_size(model: Path) -> None:
    assert [r.rank for r in _supervise("--data-parallel-size", "3").ranks] == [0, 1, 2]  # rank processes
    plan = _deploy("--data-parallel-size", "2")
    assert (plan.role, plan.dp_size_local) == ("head", 2) and plan.route_argv is not None  # ranks + router
    cpus = len(os.sched_getaffinity(0))  # one rank of a group: its share of the cores
    assert (rank_threads(None, 1, env={}), rank_threads(None, 2, env={})) == (cpus, max(1, cpus // 2))


def _walk_dp_size_local(model: Path) -> None:
    cfg = _supervise("--data-parallel-size", "4", "--data-parallel-size-local", "2", "--node-rank", "1")
    assert [r.rank for r in cfg.ranks] == [2, 3]
    assert _deploy(*HEADLESS).dp_size_local == 1
    assert rank_threads(2, 2, env={}) == max(1, len(os.sched_getaffinity(0)) // 2)


def _walk_start_rank(model: Path) -> None:
    cfg = _supervise("--data-parallel-size", "4", "--data-parallel-size-local", "2",
                     "--data-parallel-start-rank", "1")
    assert [r.rank for r in cfg.ranks] == [1, 2]  # one rank refuses it (test_serve_refuses[start-rank])
    assert _deploy(*HEADLESS, "--data-parallel-start-rank", "1").dp_start_rank == 1


def _walk_node_rank(model: Path) -> None:
    cfg = _supervise("--data-parallel-size", "2", "--data-parallel-size-local", "1", "--node-rank", "1")
    assert [r.rank for r in cfg.ranks] == [1]
    assert _deploy(*HEADLESS, "--node-rank", "1").dp_start_rank == 1


def _walk_supervisor_port(model: Path) -> None:
    base = free_port_run(3)
    cfg = parse_args(["--port", str(base), "--data-parallel-supervisor-port", str(base + 2), "--device",
                      "cpu"], env={})
    assert cfg.supervisor_port == base + 2


def _walk_backend(model: Path) -> None:
    assert _supervise("--data-parallel-size", "2", "--data-parallel-backend", "ray").backend == "ray"
    assert "--data-parallel-backend=ray" in _deploy("--data-parallel-size", "2", "--data-parallel-backend",
                                                    "ray").supervise_argv  # ranks placed through Ray


def _walk_ray_pack(model: Path) -> None:
    ray = ["--data-parallel-size", "2", "--data-parallel-backend", "ray"]
    assert _supervise(*ray, "--ray-dp-pack-strategy", "fill").ray_pack_strategy == "fill"  # Ray placement
    assert "--ray-dp-pack-strategy=fill" in _deploy(*ray, "--ray-dp-pack-strategy", "fill").supervise_argv
    _exit_2(lambda: _supervise("--data-parallel-size", "2", "--ray-dp-pack-strategy", "fill"),  # no Ray
             lambda: _deploy("--data-parallel-size", "2", "--ray-dp-pack-strategy", "fill"),
             lambda: _deploy("--ray-dp-pack-strategy", "fill"))  # one rank


def _walk_headless(model: Path) -> None:
    plan = _deploy(*HEADLESS)
    assert plan.role == "headless" and plan.route_argv is None  # ranks only, no router


def _walk_hybrid(model: Path) -> None:
    plan = _deploy("--data-parallel-size", "2", "--data-parallel-size-local", "1",
                   "--data-parallel-hybrid-lb", "--data-parallel-address", "127.0.0.1")
    assert plan.role == "hybrid" and plan.route_argv is not None  # its own router over its own ranks


def _walk_advertise(model: Path) -> None:
    assert _deploy(*HEADLESS, "--data-parallel-advertise-address", "10.1.1.1").advertise == "10.1.1.1"


def _walk_rank_port(model: Path) -> None:
    port = free_port_run(3)
    argv = _deploy("--data-parallel-size", "2", "--rank-port", str(port)).supervise_argv
    assert argv[argv.index("--port") + 1] == str(port)


def _walk_route_policy(model: Path) -> None:
    argv = _deploy("--data-parallel-size", "2", "--route-policy", "round_robin").route_argv
    assert argv[argv.index("--policy") + 1] == "round_robin"  # the deployment's router balances so
    _exit_2(lambda: _deploy(*HEADLESS, "--route-policy", "round_robin"))  # a headless node has no router


def _walk_external_lb(model: Path) -> None:
    # The one mode lbd supervise runs (a rank per port, vLLM's external LB): the flag names it so vLLM's
    # command lines work unchanged, and --help says so. Nothing else may be accepted without an effect.
    help_text = subprocess.run([sys.executable, "-m", "lbd", "supervise", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    assert "always on here" in " ".join(help_text.split())


WALK: dict[str, Callable[[Path], None]] = {
    "--tensor-parallel-size": _walk_tensor_parallel,
    "--pipeline-parallel-size": _walk_pipeline_parallel,
    "--pp-layer-partition": _walk_partition,
    "--distributed-executor-backend": _walk_executor_backend,
    "--distributed-timeout-s": _walk_timeout,
    "--enable-expert-parallel": _walk_expert_parallel,
    "--data-parallel-address": _walk_address,
    "--data-parallel-rpc-port": _walk_rpc_port,
    "--all2all-backend": _walk_all2all_backend,
    "--dp-idle-check-steps": _walk_idle_check_steps,
    "--data-parallel-rank": _walk_dp_rank,
    "--data-parallel-size": _walk_dp_size,
    "--data-parallel-size-local": _walk_dp_size_local,
    "--data-parallel-start-rank": _walk_start_rank,
    "--node-rank": _walk_node_rank,
    "--data-parallel-supervisor-port": _walk_supervisor_port,
    "--data-parallel-multi-port-external-lb": _walk_external_lb,
    "--data-parallel-backend": _walk_backend,
    "--ray-dp-pack-strategy": _walk_ray_pack,
    "--headless": _walk_headless,
    "--data-parallel-hybrid-lb": _walk_hybrid,
    "--data-parallel-advertise-address": _walk_advertise,
    "--rank-port": _walk_rank_port,
    "--route-policy": _walk_route_policy,
}


def _parallelism_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags --help lists under a parallelism or data-parallel group, and every other one about data
    parallelism or where ranks go."""
    flags = set()
    for group in parser._action_groups:
        for action in group._group_actions:
            for flag in action.option_strings:
                if ("parallel" in (group.title or "") or "parallel" in flag
                        or flag in ("--node-rank", "--rank-port", "--headless", "--ray-dp-pack-strategy")):
                    flags.add(flag)
    return flags - {"--no-data-parallel-hybrid-lb"}


def test_every_parallelism_flag_changes_what_runs_or_is_refused(tiny_llama: Path) -> None:
    from lbd.serve.plan import make_deploy_parser
    from lbd.supervisor.flags import make_parser as supervisor_parser

    found = _parallelism_flags(make_deploy_parser()[0]) | _parallelism_flags(supervisor_parser()[0])
    assert found == set(WALK), f"flags to add to the walk: {found - set(WALK)}; gone: {set(WALK) - found}"
    for check in WALK.values():
        check(tiny_llama)
