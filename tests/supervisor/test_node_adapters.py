"""The node's LoRA adapters (issue 44, supervisor part; lbd.supervisor.adapters): ``lbd supervise`` over two
``--device sim --enable-lora`` ranks. A load on the health port reaches both ranks; a rank restarted by the
admin command lists the adapter again the moment it is ready (it is loaded back before, not after); an unload
reaches both and is forgotten. The routes want the admin token."""

from __future__ import annotations

from pathlib import Path

import httpx

from support.node import SupervisorNode

TOKEN = "adapters-admin-token"
FLAGS = ["--device", "sim", "--max-model-len", "512", "--enable-lora", "--max-loras", "2",
         "--log-level", "warning"]


def _adapters(url: str) -> set[str]:
    cards = httpx.get(url + "/v1/models", timeout=5).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def test_node_adapters_reach_every_rank_and_come_back_after_a_restart(tiny_llama: Path,
                                                                      tmp_path: Path) -> None:
    node = SupervisorNode(tiny_llama, 2, "--admin-token", TOKEN, engine_flags=FLAGS,
                          log=tmp_path / "node.log", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        node.wait_ready(120)
        body = {"lora_name": "x", "lora_path": "/adapters/x"}
        assert node.client.post("/v1/load_lora_adapter", json=body).status_code == 401
        r = node.client.post("/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        assert [(a["rank"], a["status"]) for a in r.json()["ranks"]] == [(0, 200), (1, 200)]
        assert all("x" in _adapters(node.rank_url(i)) for i in (0, 1))

        pid = node.rank(1)["pid"]
        assert node.post("/ranks/1/restart", TOKEN).status_code == 202
        node.wait_for(lambda: node.rank(1)["pid"] not in (None, pid) and node.rank(1)["routable"], 60,
                      "rank 1 back")
        assert "x" in _adapters(node.rank_url(1))  # at once: loaded back before it was marked ready

        r = node.client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        assert not any("x" in _adapters(node.rank_url(i)) for i in (0, 1))
        r = node.client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=auth, timeout=30)
        assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
    finally:
        node.close()
