"""Expert-parallel token movers side by side: all-gather + reduce-scatter vs all-to-all (lbd.engine.dp).

Two processes form a gloo group (the CPU path) and time one forward pass through ``--layers`` MoE layers with
each mover, interleaved (A B A B ...), for a few tokens-per-rank sizes; prints the median microseconds per
layer and the ratio. all-gather + reduce-scatter exchanges token counts once per pass (2 collectives a layer +
1), all-to-all per layer (3 a layer). A layer: E experts of width I over hidden D, top-k routing with random
logits; the same inputs for both.

    python benchmarks/ep_dispatch.py [--tokens 1,4,16,64,256] [--layers 4] [--hidden 512] [--reps 30]

Numbers from a shared 2-core machine are noisy: quote medians, and say the machine was shared.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _member(rank: int, port: int, ns: argparse.Namespace, out: mp.Queue) -> None:
    import torch

    from lbd.engine.dp.expert_parallel import ExpertDispatcher, ExpertPlan
    from lbd.engine.dp.group import DPGroup, store_client
    from lbd.engine.models.moe import FusedExperts

    torch.set_num_threads(1)
    device = torch.device("cpu")
    group = DPGroup(store_client("127.0.0.1", port, 60), rank, 2, 1, device, 60)
    results: dict[str, dict[int, list[float]]] = {}
    movers = {}
    for backend in ("allgather_reducescatter", "alltoall"):
        plan = ExpertPlan(rank, 2, True, backend)
        shard = plan.shard(ns.experts)
        experts = FusedExperts(ns.hidden, ns.inter, shard)
        torch.manual_seed(rank)
        experts.w13.data.normal_(0, 0.02)
        experts.w2.data.normal_(0, 0.02)
        disp = ExpertDispatcher(plan, shard, device)
        disp.group = group
        movers[backend] = (disp, experts)
        results[backend] = {t: [] for t in ns.tokens}
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.inference_mode():
        for t in ns.tokens:
            x = torch.randn(t, ns.hidden, generator=gen)
            logits = torch.randn(t, ns.experts, generator=gen)
            weights, ids = torch.topk(torch.softmax(logits, -1), ns.top_k)
            ids = ids.to(torch.int32)
            for rep in range(ns.reps + 3):
                for backend, (disp, experts) in movers.items():
                    group.all_reduce(torch.zeros(1))  # start together
                    t0 = time.perf_counter()
                    for layer in range(ns.layers):
                        disp(experts, x, weights, ids, layer)
                    if rep >= 3:
                        results[backend][t].append((time.perf_counter() - t0) / ns.layers)
    out.put((rank, results))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,4,16,64,256")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="MoE layers per forward pass")
    p.add_argument("--reps", type=int, default=30)
    ns = p.parse_args()
    ns.tokens = [int(t) for t in ns.tokens.split(",")]
    from lbd.engine.dp.group import host_store

    store = host_store(0, 60)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, store.port, ns, q)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(f"EP=2 over gloo (CPU), D={ns.hidden} I={ns.inter} E={ns.experts} top-{ns.top_k}, "
          f"{ns.layers} layers a pass, median of {ns.reps} interleaved passes, rank 0's view (us per layer)")
    print(f"{'tokens/rank':>11} {'allgather+RS':>13} {'all-to-all':>11} {'a2a / agrs':>11}")
    for t in ns.tokens:
        ag = statistics.median(results[0]["allgather_reducescatter"][t]) * 1e6
        a2a = statistics.median(results[0]["alltoall"][t]) * 1e6
        print(f"{t:>11} {ag:>13.0f} {a2a:>11.0f} {a2a / ag:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
