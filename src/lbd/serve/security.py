"""`lbd serve`'s checks of what protects a deployment, run with the others before anything starts: TLS on
every port and link, and the cluster token of a group that spans machines (``lbd.common.cluster``), which
must be strong: 256 bits or more by its estimate, since keys derived from it are checked on wires."""

from __future__ import annotations

import argparse

from lbd.common.cluster import NO_TOKEN_FIX, ClusterTokenError, is_loopback, read_strong_token
from lbd.supervisor.flags import SupervisorArgError


def check_tls(ns: argparse.Namespace, role: str, remote: bool, moe_group: bool) -> None:
    """TLS covers every port of the deployment: the API port (the router), health ports, supervisors, ranks,
    and in a group that spans nodes the registration with the head and the links between nodes (the head's
    router verifies the remote ranks). Each part verifies the others against --ssl-ca-certs, so a node's
    certificate names the addresses others reach it at (its advertised address, and 127.0.0.1 for the parts
    on the same machine). An MoE group across nodes (its coordinator's port), Ray-placed ranks and client
    certificates are refused rather than half-applied."""
    given = [flag for flag, value in (("--ssl-certfile", ns.ssl_certfile), ("--ssl-keyfile", ns.ssl_keyfile),
                                      ("--ssl-ca-certs", ns.ssl_ca_certs)) if value is not None]
    if not given:
        return
    spans = remote or role != "head"
    where = ("an MoE group that spans nodes" if spans and moe_group else
             "--data-parallel-backend ray" if ns.data_parallel_backend == "ray" else None)
    if where is not None:
        raise SupervisorArgError(f"{given[0]}: TLS is not implemented for {where} yet: serve TLS with lbd "
                                 "supervise --ssl-certfile ... per node and lbd route --ssl-certfile ... in "
                                 "front (README, TLS), or drop it")
    if ns.ssl_cert_reqs:
        raise SupervisorArgError("--ssl-cert-reqs: client certificates are not implemented for an lbd serve "
                                 "--data-parallel-size N deployment (its router would need one towards the "
                                 "ranks): drop it, or run lbd supervise + lbd route")
    if ns.ssl_certfile is None:
        raise SupervisorArgError(f"{given[0]} needs --ssl-certfile (and --ssl-keyfile): the deployment "
                                 "serves TLS with that certificate on every port")


def cluster_token(ns: argparse.Namespace, env: dict[str, str]) -> str | None:
    """The cluster token: ``--cluster-token-file``, else $LBD_CLUSTER_TOKEN; refused (exit 2) below 256 bits
    (lbd.common.cluster.read_strong_token): the deployment's internal key and CURVE keys derive from it."""
    try:
        return read_strong_token(ns.cluster_token_file, env)
    except ClusterTokenError as e:
        raise SupervisorArgError(str(e)) from None


def check_cluster_auth(address: str | None, token: str | None, insecure: bool) -> None:
    """A group across machines whose registration (the head's --data-parallel-address) is beyond loopback
    needs the cluster token, or --insecure-cluster: anyone who reaches an open head can register ranks and
    have the router send them users' prompts (and a node without the token would be refused by a head that
    has one)."""
    if address is not None and token is None and not insecure and not is_loopback(address):
        raise SupervisorArgError(f"--data-parallel-address {address} is beyond loopback and the group's "
                                 f"registration would take any caller: {NO_TOKEN_FIX}")
