"""A profile composed in a --routing-config file (a filter and two weighted scorers) routes a real `lbd route`
over stub upstreams; x-lbd-route-reason and /router/status name the plugin that decided."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from support.router_stubs import stubs

BODY = {"model": "stub-model", "prompt": "hello there"}


def write_profile(tmp_path: Path, kv_weight: float) -> Path:
    path = tmp_path / f"profile-{kv_weight:g}.json"
    path.write_text(json.dumps({
        "name": "kv_mix",
        "filters": [{"plugin": "kv_room", "kv_full": 0.9}],
        "scorers": [{"plugin": "queue", "weight": 1},
                    {"plugin": "kv_pressure", "kv_threshold": 0.5, "weight": kv_weight}],
    }))
    return path


async def test_a_routing_config_profile_routes_and_names_the_deciding_plugin(start_router, tmp_path) -> None:
    async with stubs(3) as ups:
        ups[0].kv_usage = 0.95  # idle, KV nearly full: kv_room drops it
        ups[1].waiting = 2  # queue score 8, cool cache
        ups[2].kv_usage = 0.8  # idle, KV pressure 0.6
        urls = ",".join(u.url for u in ups)
        light, heavy = (await asyncio.gather(*(
            start_router("--upstreams", urls, "--debug-headers", "--routing-config",
                         str(write_profile(tmp_path, w))).wait() for w in (10.0, 20.0))))
        await asyncio.sleep(0.6)  # scraped (--scrape-interval-ms 100)
        async with httpx.AsyncClient(timeout=10) as c:
            for router, rank, head in ((light, 2, "least_load (queue): "),
                                       (heavy, 1, "kv_aware (kv_pressure): ")):
                for _ in range(3):  # light: 6 (pressure x 10) beats 8 (queue); heavy: 12 loses to 8
                    resp = await c.post(router.url + "/v1/completions", json=BODY)
                    assert resp.status_code == 200 and resp.json()["rank"] == rank, resp.headers
                    assert resp.headers["x-lbd-route-reason"].startswith(head), resp.headers
                status = (await c.get(router.url + "/router/status")).json()
                assert status["policy"] == "kv_mix" and status["profile"]["filters"] == ["kv_room"]
                assert [s["plugin"] for s in status["profile"]["scorers"]] == ["queue", "kv_pressure"]
                assert sum(status["profile"]["decided"].values()) == 3, status["profile"]
        assert ups[0].served == 0
