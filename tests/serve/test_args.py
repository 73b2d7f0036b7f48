"""`lbd serve` flags: which mode they pick, what each child gets, and every refused combination (exit 2)."""

from __future__ import annotations

import pytest

from lbd.serve.plan import parse
from support import free_port_run

GROUP = ["--data-parallel-size", "4", "--data-parallel-size-local", "2"]
ADDR = ["--data-parallel-address", "10.0.0.1"]
STRONG = "ODG03F0Jyu3LF8aTASnhv4rlnFw1Q9SfN4h0qOziHr8"  # a cluster token of 256 bits or more
TOKEN = {"LBD_CLUSTER_TOKEN": STRONG}  # a group beyond loopback needs one (tests/serve/test_cluster_auth.py)


def _ports() -> list[str]:
    base = free_port_run(5)
    return ["--port", str(base), "--data-parallel-supervisor-port", str(base + 4), "--device", "sim"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        parse([*_ports(), *argv], env=TOKEN)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lbd serve: error: ") or "lbd route: error" in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["--data-parallel-rank", "0", "--data-parallel-size", "2", "--headless"],
            ["--data-parallel-rank 0", "--headless"],
        ),
        (["--data-parallel-size", "2", "--headless", "--data-parallel-hybrid-lb"], ["exclude each other"]),
        ([*GROUP], ["pass --data-parallel-address"]),  # a head with remote ranks must say where to register
        (
            [*GROUP, "--headless", "--data-parallel-start-rank", "2"],
            ["registers its ranks", "--data-parallel-address"],
        ),
        ([*GROUP, *ADDR, "--data-parallel-start-rank", "2"], ["runs with --headless"]),
        ([*GROUP, *ADDR, "--node-rank", "1"], ["runs with --headless"]),
        ([*GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "3"], ["use a start rank in 0..2"]),
        (
            ["--data-parallel-size", "4", "--data-parallel-size-local", "3", *ADDR, "--headless"],
            ["not divisible"],
        ),
        (["--data-parallel-size", "2", "--data-parallel-size-local", "3", *ADDR], ["larger than"]),
        (
            [*GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2", "--api-server-count", "2"],
            ["--api-server-count", "runs no router"],
        ),
        (
            [*GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2", "--max-num-queued-reqs", "4"],
            ["--max-num-queued-reqs", "head's router"],
        ),
        (
            [*GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2", "--route-policy", "round_robin"],
            ["--route-policy does nothing"],
        ),
        (
            ["--data-parallel-size", "4", "--data-parallel-size-local", "0", *ADDR, "--headless"],
            ["nothing to run"],
        ),
        (
            [
                "--data-parallel-size",
                "4",
                "--data-parallel-size-local",
                "0",
                *ADDR,
                "--data-parallel-hybrid-lb",
            ],
            ["nothing to run"],
        ),
        (["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--headless"], ["drop --headless"]),
        (
            ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--data-parallel-hybrid-lb"],
            ["drop --data-parallel-hybrid-lb"],
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-backend", "ray", *ADDR],
            ["drop --data-parallel-address"],
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--rank-port", "9000"],
            ["--rank-port"],
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ray-dp-pack-strategy", "span"],
            ["span", "--distributed-executor-backend ray"],
        ),
        (
            [
                "--data-parallel-size",
                "2",
                "--data-parallel-backend",
                "ray",
                "--data-parallel-start-rank",
                "1",
            ],
            ["drop --node-rank and --data-parallel-start-rank"],
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-advertise-address", "10.0.0.2"],
            ["--data-parallel-advertise-address does nothing"],
        ),
        (
            ["--data-parallel-size", "2", "--data-parallel-rpc-port", "29550"],
            ["--data-parallel-rpc-port does nothing"],
        ),
        (["--data-parallel-size", "2", "--ready-policy", "3"], ["--ready-policy 3", "at most 2"]),
        (
            [*GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2", "--ready-policy", "3"],
            ["at most 2"],
        ),
        (["--data-parallel-size", "2", "--api-server-count", "65"], ["--workers 65 is more than 64"]),
        (["--headless"], ["registers its ranks"]),  # --headless alone is a deployment (of one rank)
        (["--data-parallel-size", "2", "--block-size", "3"], ["--block-size must be a power of two"]),
        # a group across nodes takes TLS on every link (test_deploy_multinode.py): a missing file is named
        ([*GROUP, *ADDR, "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"],
         ["--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: cannot load"]),
        (["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--ssl-certfile", "c.pem"],
         ["not implemented for --data-parallel-backend ray"]),
        (["--data-parallel-size", "2", "--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"],
         ["--ssl-cert-reqs: client certificates are not implemented"]),
        (["--data-parallel-size", "2", "--ssl-ca-certs", "ca.pem"], ["--ssl-ca-certs needs --ssl-certfile"]),
    ],
)
def test_refused_combinations(
    argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(argv, capsys)
    for needle in needles:
        assert needle in err, err


def test_router_port_inside_rank_ports(capsys: pytest.CaptureFixture[str]) -> None:
    base = free_port_run(3)
    with pytest.raises(SystemExit):
        parse(
            ["--port", str(base), "--rank-port", str(base), "--data-parallel-size", "2", "--device", "sim"],
            {},
        )
    assert "inside the rank ports" in capsys.readouterr().err


def test_deployment_flags_refused_on_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, flag in (
        (["--ready-policy", "any"], "--ready-policy"),
        (["--data-parallel-rank", "1", "--data-parallel-size", "2", "--rank-port", "9000"], "--rank-port"),
    ):
        with pytest.raises(SystemExit):
            parse(argv, {})
        assert f"{flag} applies to a data-parallel deployment" in capsys.readouterr().err


def test_single_rank_stays_the_engine() -> None:
    assert parse(["--port", "8000"], {}) is None
    assert parse(["--data-parallel-size", "4", "--data-parallel-rank", "2", "--port", "8000"], {}) is None


def test_internal_head_plan() -> None:
    ports = _ports()
    plan = parse(
        [
            *ports,
            "--data-parallel-size",
            "2",
            "--api-server-count",
            "3",
            "--max-num-queued-reqs",
            "4",
            "--max-num-queued-tokens",
            "1000",
            "--max-num-seqs",
            "8",
            "--ready-policy",
            "1",
        ],
        {},
    )
    assert plan is not None and plan.role == "head" and not plan.registry and not plan.member
    sup = plan.supervise_argv
    assert "--max-num-seqs=8" in sup  # per rank
    assert not any(a.startswith(("--max-num-queued", "--api-server-count", "--ready-policy")) for a in sup)
    assert sup[sup.index("--host") + 1] == "127.0.0.1"  # one node: ranks on loopback behind the router
    assert sup[sup.index("--port") + 1] == str(int(ports[1]) + 1)
    route = plan.route_argv
    assert route is not None
    assert route[route.index("--workers") + 1] == "3"  # --api-server-count = the router's workers
    assert route[route.index("--max-num-queued-reqs") + 1] == "4"
    assert route[route.index("--max-num-queued-tokens") + 1] == "1000"
    assert route[route.index("--min-ready-endpoints") + 1] == "1"


def test_keys_and_limits_reach_both_children() -> None:
    """--api-key (and $VLLM_API_KEY) go to the supervisor and the router by environment, never on their
    command lines; the connection limits the user set apply on the router's port too."""
    plan = parse([*_ports(), "--data-parallel-size", "2", "--api-key", "k-one", "k-two", "--max-headers",
                  "50", "--header-read-timeout-s", "3"], {"VLLM_API_KEY": "k-env"})
    assert plan is not None and plan.api_keys == ["k-one", "k-two", "k-env"]
    assert "k-one" not in repr(plan)
    route = plan.route_argv
    assert route is not None
    for argv in (plan.supervise_argv, route):
        assert not any("k-one" in a or "k-env" in a or a == "--api-key" for a in argv), argv
    assert "--max-headers=50" in route and "--header-read-timeout-s=3.0" in route
    assert not any(a.startswith("--max-connections") for a in route)  # defaults stay defaults
    assert plan.limits.max_headers == 50  # the node's own health port too
    from lbd.serve.node import key_env

    internal = {"LBD_INTERNAL_KEY": plan.internal_key}  # made per deployment: signs the router's ids
    assert len(plan.internal_key) == 64 and plan.internal_key not in repr(plan)
    assert key_env(plan, "supervisor") == {"LBD_API_KEYS": "k-one\nk-two\nk-env", **internal}
    assert key_env(plan, "router") == {"LBD_ROUTER_API_KEYS": "k-one\nk-two\nk-env",
                                       "LBD_UPSTREAM_API_KEY": "k-one", **internal}
    open_plan = parse([*_ports(), "--data-parallel-size", "2"], {})
    assert open_plan is not None
    assert key_env(open_plan, "router") == {"LBD_INTERNAL_KEY": open_plan.internal_key}
    assert open_plan.internal_key != plan.internal_key  # none given: each node makes its own
    given = parse([*_ports(), "--data-parallel-size", "2"], {"LBD_INTERNAL_KEY": STRONG + "-mine"})
    token = parse([*_ports(), "--data-parallel-size", "2"], {"LBD_CLUSTER_TOKEN": STRONG})
    again = parse([*_ports(), "--data-parallel-size", "2"], {"LBD_CLUSTER_TOKEN": STRONG})
    assert given is not None and given.internal_key == STRONG + "-mine"
    assert token is not None and again is not None and token.internal_key == again.internal_key != STRONG


def test_multi_node_plans() -> None:
    head = parse([*_ports(), *GROUP, *ADDR], TOKEN)
    assert head is not None and head.registry and head.view_size == 4 and head.ready_needed == 4
    assert "--host" not in head.supervise_argv  # reachable from the head's router and other routers
    assert not any("10.0.0.1" in a for a in head.supervise_argv)  # the group's address is not a rank flag
    worker = parse(
        [*_ports(), *GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2"],
        {"LBD_CLUSTER_TOKEN": STRONG + "-worker"},
    )
    assert worker is not None and worker.member and worker.route_argv is None and worker.view_size == 2
    assert worker.cluster_token == STRONG + "-worker" and worker.rpc_port == 29550
    sup = worker.supervise_argv
    assert sup[sup.index("--data-parallel-start-rank") + 1] == "2"
    assert sup[sup.index("--port") + 1] == _port_of(worker)  # a headless node's ranks start at --port
    router_only = parse(
        [*_ports(), "--data-parallel-size", "4", "--data-parallel-size-local", "0", *ADDR], TOKEN
    )
    assert router_only is not None and router_only.registry and router_only.dp_size_local == 0
    lws = parse([*_ports(), *GROUP, *ADDR, "--headless", "--node-rank", "1"], TOKEN)
    assert lws is not None and lws.dp_start_rank == 2  # LeaderWorkerSet: --node-rank $(LWS_WORKER_INDEX)
    hybrid = parse(
        [*_ports(), *GROUP, *ADDR, "--data-parallel-hybrid-lb", "--data-parallel-start-rank", "2"], TOKEN
    )
    assert hybrid is not None and hybrid.member and hybrid.route_argv is not None and hybrid.view_size == 2


def _port_of(plan: object) -> str:
    return str(plan.router_port)  # type: ignore[attr-defined]


def test_ray_plan() -> None:
    plan = parse(
        [
            *_ports(),
            "--data-parallel-size",
            "4",
            "--data-parallel-size-local",
            "2",
            "--data-parallel-backend",
            "ray",
            "--api-server-count",
            "2",
        ],
        {},
    )
    assert plan is not None and plan.dp_size_local == 4 and not plan.registry
    sup = plan.supervise_argv
    assert "--data-parallel-backend=ray" in sup and sup[sup.index("--data-parallel-size-local") + 1] == "2"
