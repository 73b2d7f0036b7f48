"""/status types (lbd.wire.status): each round-trips through JSON, keeps the wire's field names, and decodes
what older or newer peers send (fewer fields, unknown fields, unknown states)."""

from __future__ import annotations

import msgspec
import orjson

from lbd.wire.dp import DPState, DPStatus, Wave
from lbd.wire.roles import NodeRole
from lbd.wire.status import (
    CoordinatorInfo,
    Deployment,
    EngineStatus,
    GroupMember,
    GroupRendezvous,
    GroupStatus,
    GroupView,
    LastRecovery,
    NodeInfo,
    NodePhase,
    ProbeSettings,
    RankState,
    RankStatus,
    Recovery,
    Registration,
    RegistryRendezvous,
    Rejection,
    RollingRestart,
    RollingState,
    RouterInfo,
    SupervisorStatus,
    WorkerProcess,
    decode_engine_status,
    decode_supervisor_status,
    encode,
)


def _full() -> SupervisorStatus:
    rank = RankStatus(rank=0, local_rank=0, url="http://10.0.0.5:8000", port=8000, pid=42,
                      state=RankState.READY, routable=True, state_since=1.5, restarts=1,
                      workers=[WorkerProcess(50, 0, 0, 0, "0-3")],
                      stderr_tail=["x"], command=["python", "-m", "lbd.engine"],
                      kv_event_sources={"0": {"enable_kv_cache_events": True}}, group=0)
    group = GroupStatus(model="MixtralForCausalLM", num_experts=8, size=2, local_ranks=[0, 1], ready=True,
                        reason="ok", generation=2, state=DPState.READY, wave=Wave(True, 3, 9),
                        generation_aborts=1,
                        rendezvous=GroupRendezvous("127.0.0.1", 29550, 29551, 29552, 29553),
                        coordinator=CoordinatorInfo(url="http://127.0.0.1:29553", local=True, alive=True),
                        members=[GroupMember(rank=0, local=True, state=RankState.READY, joined=True)],
                        recovering=[Recovery(rank=1, why="killed")],
                        last_recovery=LastRecovery(rank=1, why="killed", ready_after_s=1.0, ranks=[1]))
    return SupervisorStatus(ready=True, reason="2/2 ranks ready (policy all)", phase=NodePhase.RUNNING, pid=7,
                            node_rank=0, data_parallel_size=2, ready_policy="all", ready_ranks=2,
                            probe=ProbeSettings(5.0, 5.0, 3, 0), ranks=[rank], groups=[group],
                            rolling_restart=RollingRestart(state=RollingState.DONE, done_ranks=[0, 1]))


def test_supervisor_status_round_trips_with_the_wires_field_names() -> None:
    status = _full()
    body = encode(status)
    assert decode_supervisor_status(body) == status
    data = orjson.loads(body)
    assert data["ranks"][0]["state"] == "ready" and data["ranks"][0]["routable"] is True
    assert data["groups"][0]["state"] == "ready" and data["groups"][0]["wave"] == {"active": True, "id": 3,
                                                                                  "count": 9}
    assert data["rolling_restart"]["state"] == "done" and data["phase"] == "running"
    assert data["ranks"][0]["workers"] == [{"pid": 50, "rank": 0, "tp_rank": 0, "pp_rank": 0, "cpus": "0-3"}]
    # fields that apply only sometimes are absent, not null, where they do not
    assert "supervisor_pid" not in data and "deployment" not in data and "node" not in data["ranks"][0]
    assert data["ranks"][0]["group"] == 0


def test_older_and_newer_peers_decode() -> None:
    # a stand-in or an older supervisor: a few fields; routable left out reads as "state is ready"
    old = decode_supervisor_status(b'{"ready": true, "ranks": [{"rank": 0, "url": "http://a:1", '
                                   b'"state": "ready", "pid": 3}, {"rank": 1, "url": "http://a:2", '
                                   b'"state": "draining"}]}')
    assert [(r.rank, r.state, r.routable) for r in old.ranks] == [(0, RankState.READY, True),
                                                                  (1, RankState.DRAINING, False)]
    assert old.live is True and old.groups == []
    # a newer one: unknown fields skipped, unknown states read "unknown"
    rank = {"rank": 0, "url": "http://a:1", "state": "warming", "routable": False, "new_field": {"x": 1}}
    new = decode_supervisor_status(orjson.dumps({"ready": False, "phase": "hibernating", "shiny": [1],
                                                 "ranks": [rank]}))
    assert new.phase is NodePhase.UNKNOWN and new.ranks[0].state is RankState.UNKNOWN
    assert new.ranks[0].routable is False


def test_engine_status_round_trips() -> None:
    status = EngineStatus(rank=0, pid=1, core_pid=2, ready=False,
                          dp=DPStatus(state=DPState.REFORMING, generation=2, reason="rank 1 failed"))
    body = encode(status)
    assert decode_engine_status(body) == status
    assert orjson.loads(body)["dp"] == {"state": "reforming", "generation": 2, "reason": "rank 1 failed",
                                        "expert_parallel": False, "all2all_backend": "alltoall",
                                        "wave_active": False, "waves": 0, "steps": 0, "dummy_steps": 0}
    assert decode_engine_status(b'{"rank": 0, "pid": 1, "core_pid": 2, "ready": true, "dp": null}').dp is None


def test_structs_are_plain_msgspec() -> None:
    assert msgspec.json.decode(msgspec.json.encode(_full()), type=SupervisorStatus) == _full()


def test_serve_status_with_its_deployment_round_trips() -> None:
    met = RegistryRendezvous("10.0.0.1", 29550, 29551, 29552, 29553)
    group = GroupView(data_parallel_size=4, lease_s=3.0, models=["m"], head_ranks=[0, 1],
                      nodes=[NodeInfo(node_id="n1", address="10.0.0.2", ranks=[2, 3], state="lost")],
                      rejected=[Rejection(at=1.0, address="10.0.0.3", ranks="2-3", reason="x")])
    deployment = Deployment(role=NodeRole.HEAD, data_parallel_size=4, data_parallel_size_local=2,
                            registry=True, group=group, rendezvous=met, router=RouterInfo(8000, 1, True))
    status = SupervisorStatus(ready=True, supervisor_pid=5, deployment=deployment,
                              ranks=[RankStatus(rank=2, state=RankState.UNREACHABLE, routable=False,
                                                node="10.0.0.2")])
    body = encode(status)
    assert decode_supervisor_status(body) == status
    data = orjson.loads(body)
    assert data["deployment"]["role"] == "head" and data["deployment"]["rendezvous"]["store_port"] == 29551
    assert "registration" not in data["deployment"] and data["supervisor_pid"] == 5
    assert data["ranks"][0]["node"] == "10.0.0.2" and data["ranks"][0]["state"] == "unreachable"
    member = Deployment(role=NodeRole.HEADLESS, registration=Registration(state="registered", rendezvous=met))
    assert msgspec.json.decode(msgspec.json.encode(member), type=Deployment) == member
