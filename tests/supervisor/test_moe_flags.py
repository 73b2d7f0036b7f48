"""MoE groups from the command line: which models form a group, where it meets, what each rank gets, and
every combination that means nothing (exit 2, one line naming the flag). In-process: nothing is started."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from lbd.engine.config.args import make_parser
from lbd.serve.plan import parse as deploy_parse
from lbd.supervisor.config import parse_args
from lbd.supervisor.moe import free_rpc_port, moe_facts
from support import free_port_run


def _args(model: Path, *extra: str, size: int = 2, local: int | None = None) -> tuple[int, list[str]]:
    base = free_port_run(5)
    args = ["--model", str(model), "--device", "cpu", "--host", "127.0.0.1", "--port", str(base),
            "--supervisor-host", "127.0.0.1", "--data-parallel-supervisor-port", str(base + 4),
            "--data-parallel-size", str(size), *extra]
    return base, args + (["--data-parallel-size-local", str(local)] if local is not None else [])


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(argv, env={})
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lbd supervise: error: ") and "\n" not in err, err
    return err


def test_which_models_are_moe(tiny_mixtral: Path, tiny_qwen3_moe: Path, tiny_deepseek_v2: Path,
                              tiny_qwen3: Path, tiny_llama: Path) -> None:
    assert moe_facts(str(tiny_mixtral)).architecture == "MixtralForCausalLM"  # type: ignore[union-attr]
    assert moe_facts(str(tiny_qwen3_moe)).num_experts == 8  # type: ignore[union-attr]
    assert moe_facts(str(tiny_deepseek_v2)).architecture == "DeepseekV2ForCausalLM"  # type: ignore[union-attr]
    assert moe_facts(str(tiny_qwen3)) is None and moe_facts(str(tiny_llama)) is None
    assert moe_facts("/no/such/model") is None


def test_moe_ranks_form_a_group_on_loopback(tiny_mixtral: Path) -> None:
    base, argv = _args(tiny_mixtral, "--enable-expert-parallel")
    cfg = parse_args(argv, env={})
    group = cfg.group
    assert group is not None and group.size == 2 and group.local_ranks == (0, 1) and group.runs_coordinator
    assert group.address == "127.0.0.1" and group.expert_parallel and cfg.on_rank_failure == "restart-group"
    for spec in cfg.ranks:
        ns = make_parser().parse_args(spec.argv[3:])
        assert ns.data_parallel_address == "127.0.0.1" and ns.data_parallel_rpc_port == group.rpc_port
        assert ns.enable_expert_parallel and ns.data_parallel_size == 2
    # the store, the coordinator and its HTTP port above P are free (P itself is lbd serve's registration)
    for port in range(group.rpc_port + 1, group.rpc_port + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert group.coordinator_url == f"http://127.0.0.1:{group.rpc_port + 3}"
    argv_c = group.coordinator_argv(sys.executable, "info")
    assert argv_c[1:3] == ["-m", "lbd.engine.dp.coordinator"] and str(group.rpc_port) in argv_c


def test_node_of_a_larger_group_meets_at_rank_0s_node(tiny_mixtral: Path) -> None:
    rpc = free_port_run(4)
    _, argv = _args(tiny_mixtral, "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port",
                    str(rpc), "--node-rank", "1", size=4, local=2)
    cfg = parse_args(argv, env={})
    assert cfg.group is not None and not cfg.group.runs_coordinator and cfg.group.local_ranks == (2, 3)
    assert cfg.group.rpc_port == rpc


def test_dense_ranks_stay_independent(tiny_llama: Path) -> None:
    _, argv = _args(tiny_llama)
    cfg = parse_args(argv, env={})
    assert cfg.group is None and cfg.on_rank_failure == "restart-rank"
    assert not any("--data-parallel-address" in a for a in cfg.ranks[0].argv)
    _, argv = _args(tiny_llama, "--on-rank-failure", "restart")  # "restart": the model's default
    assert parse_args(argv, env={}).on_rank_failure == "restart-rank"


def test_free_rpc_port_leaves_three_free_ports_above() -> None:
    port = free_rpc_port()
    for p in range(port + 1, port + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.parametrize(("model", "extra", "needles"), [
    ("tiny_llama", ["--enable-expert-parallel"], ["--enable-expert-parallel", "dense", "drop it"]),
    ("tiny_llama", ["--data-parallel-address", "127.0.0.1"], ["--data-parallel-address", "dense"]),
    ("tiny_llama", ["--on-rank-failure", "restart-group"], ["restart-group", "dense", "restart-rank"]),
    ("tiny_mixtral", ["--on-rank-failure", "restart-rank"], ["restart-rank", "one group", "restart-group"]),
    ("tiny_mixtral", ["--ready-policy", "any"], ["--ready-policy any", "every member"]),
    ("tiny_mixtral", ["--data-parallel-backend", "ray"], ["--data-parallel-backend ray", "use mp"]),
    ("tiny_mixtral", ["--data-parallel-rpc-port", "65534"], ["--data-parallel-rpc-port 65534", "1..65532"]),
])
def test_meaningless_combinations_exit_2(model: str, extra: list[str], needles: list[str],
                                         request: pytest.FixtureRequest,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    _, argv = _args(request.getfixturevalue(model), *extra)
    err = _refused(argv, capsys)
    for needle in needles:
        assert needle in err, err


def test_restart_group_with_one_rank_exit_2(tiny_mixtral: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, argv = _args(tiny_mixtral, "--on-rank-failure", "restart-group", size=1)
    assert "served by one DP rank has no group" in _refused(argv, capsys)


def test_group_across_nodes_needs_the_address(tiny_mixtral: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, argv = _args(tiny_mixtral, size=4, local=2)
    err = _refused(argv, capsys)
    assert "spans nodes" in err and "--data-parallel-address" in err


def test_group_ports_taken(tiny_mixtral: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, argv = _args(tiny_mixtral)
    err = _refused([*argv, "--data-parallel-rpc-port", str(base - 1)], capsys)  # its store = rank 0's port
    assert f"--data-parallel-rpc-port {base - 1}" in err and "rank port of local rank 0" in err, err
    rpc = free_port_run(4)
    with socket.socket() as held:
        held.bind(("127.0.0.1", rpc + 2))
        held.listen()
        _, argv = _args(tiny_mixtral, "--data-parallel-rpc-port", str(rpc))
        err = _refused(argv, capsys)
    assert f"--data-parallel-rpc-port {rpc}" in err and "coordinator" in err and "in use" in err, err


def test_lbd_serve_passes_the_rendezvous_to_every_node(tiny_mixtral: Path, tiny_llama: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base = free_port_run(8)
    common = ["--model", str(tiny_mixtral), "--device", "cpu", "--data-parallel-size", "4",
              "--data-parallel-size-local", "2", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(base + 4)]
    head = deploy_parse([*common, "--port", str(base), "--data-parallel-supervisor-port", str(base + 3)], {})
    assert head is not None
    sup = head.supervise_argv
    assert sup[sup.index("--data-parallel-address") + 1] == "127.0.0.1"
    assert sup[sup.index("--data-parallel-rpc-port") + 1] == str(base + 4)
    worker = deploy_parse([*common, "--headless", "--data-parallel-start-rank", "2", "--port", str(base),
                           "--data-parallel-supervisor-port", str(base + 3)], {})
    assert worker is not None and "--data-parallel-address" in worker.supervise_argv
    # one node, no flags: the supervisor picks loopback and free ports itself
    one = deploy_parse(["--model", str(tiny_mixtral), "--device", "cpu", "--data-parallel-size", "2",
                        "--port", str(base), "--data-parallel-supervisor-port", str(base + 3)], {})
    assert one is not None and "--data-parallel-address" not in one.supervise_argv
    # a dense model on one node has no use for them
    with pytest.raises(SystemExit):
        deploy_parse(["--model", str(tiny_llama), "--device", "cpu", "--data-parallel-size", "2",
                      "--data-parallel-rpc-port", "29600", "--port", str(base),
                      "--data-parallel-supervisor-port", str(base + 3)], {})
    assert "--data-parallel-rpc-port does nothing here" in capsys.readouterr().err
