"""`lbd serve` as vLLM's data-parallel deployments, built from lbd's parts.

One `lbd serve` process per node runs, as children that die with it (own process groups, PR_SET_PDEATHSIG):
`lbd supervise` for the node's ranks (on an internal loopback health port) and, where the node balances,
`lbd route`. The process itself serves the node's health port and, on the head, the registration service.

- `lbd serve` (one rank, or `--data-parallel-rank R`): the engine alone (`lbd.engine.launch`).
- `lbd serve --data-parallel-size N`: internal LB, a supervisor for N ranks + the router on `--port`.
- `... --data-parallel-size-local L --data-parallel-address A`: the head of a multi-node group: ranks
  0..L-1, the router over all N, the registration service on `A:--data-parallel-rpc-port`.
- `... --headless --data-parallel-start-rank S --data-parallel-address A`: a worker node: a supervisor for
  ranks S..S+L-1, registered with the head.
- `... --data-parallel-hybrid-lb`: every node its own router over its own ranks; nodes still register with
  rank 0's node.
- `... --data-parallel-backend ray`: one supervisor places all N ranks on the Ray cluster, router on `--port`.

Ports on a node: `--port` (8000) the router; `--rank-port` (default `--port` + 1, on a headless node `--port`)
+ local rank the ranks; `--data-parallel-supervisor-port` (9256) the health port; on the head
`--data-parallel-rpc-port` (29550) the registration service, with P+1 and P+2 set aside for the DP group's
torch.distributed store and coordinator (see `lbd.serve.group.rendezvous`).

Where they listen (README, "Cluster wires"): on one machine (no remote nodes, or a group that meets at a
loopback --data-parallel-address) everything but the router's port stays on loopback; across machines the
ranks and health ports take every interface (or a headless node's --host) and the registration port the
head's address only. A group across machines needs the cluster token (``LBD_CLUSTER_TOKEN`` or
``--cluster-token-file``; ``lbd.common.cluster``) unless ``--insecure-cluster``, and with ``--ssl-certfile``
its links between nodes are HTTPS.
"""
