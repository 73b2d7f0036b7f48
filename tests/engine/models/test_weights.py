"""MoE/MLA models at the module level: both checkpoint layouts of the experts load alike, expert shards
(expert-parallel ranges and tensor-parallel slices) sum to the whole layer, MoE layer placement follows
the config, and flags a model cannot honour are named."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lbd.engine.config.architectures import unsupported_flags
from lbd.engine.loader import load_weights
from lbd.engine.models import build_model
from lbd.engine.models.config import load_hf_config
from lbd.engine.models.deepseek_v2 import deepseek_moe
from lbd.engine.models.llama import MLP
from lbd.engine.models.moe import ExpertShard, SparseMoE
from lbd.engine.models.qwen3 import qwen3_moe_sparse_layers


def _ours(path: Path, **options: object) -> torch.nn.Module:
    model = build_model(load_hf_config(path), 256, **options)
    load_weights(model, path)
    return model


def _fused_copy(src: Path, dst: Path) -> Path:
    """The checkpoint as transformers 5 holds it in memory: experts as 3-D gate_up_proj / down_proj."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst,
                                                                                   save_original_format=False)
    return dst


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_fused_and_per_expert_layouts_load_alike(kind: str, request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    from safetensors import safe_open

    hub = request.getfixturevalue(f"tiny_{kind}")
    fused = _fused_copy(hub, tmp_path / "fused")
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    a, b = _ours(hub).state_dict(), _ours(fused).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_expert_shards_sum_to_the_whole_layer(tiny_deepseek_v2: Path) -> None:
    whole = _ours(tiny_deepseek_v2)
    # 8 experts over two expert-parallel ranks unevenly (3 + 5), each also split in two TP slices
    shards = [ExpertShard(8, 0, 3, tp_rank=r, tp_size=2) for r in range(2)]
    shards += [ExpertShard(8, 3, 8, tp_rank=r, tp_size=2) for r in range(2)]
    parts = [_ours(tiny_deepseek_v2, expert_shard=s) for s in shards]
    moe = whole.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.experts.expert_map is None
    assert tuple(parts[2].model.layers[1].mlp.experts.w13.shape) == (5, 32, 64)  # 5 experts, 16 + 16 rows
    assert parts[0].model.layers[1].mlp.experts.expert_map.tolist() == [0, 1, 2] + [-1] * 5
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.gate(x)
    total = sum(p.model.layers[1].mlp.experts(x, weights, ids) for p in parts)
    torch.testing.assert_close(total, moe.experts(x, weights, ids), rtol=1e-5, atol=1e-6)
    # everything but the routed experts is whole on every shard
    for p in parts:
        torch.testing.assert_close(p.model.layers[1].mlp.shared_experts.gate_up_proj.weight,
                                   moe.shared_experts.gate_up_proj.weight)


def test_even_expert_split() -> None:
    ranges = [(s.start, s.stop) for s in (ExpertShard.even(10, r, 4) for r in range(4))]
    assert ranges == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="not inside"):
        ExpertShard(8, 5, 9)


def test_moe_layer_placement(tiny_qwen3_moe: Path, tiny_deepseek_v2: Path) -> None:
    def qwen(**kw: object) -> set[int]:
        return qwen3_moe_sparse_layers(SimpleNamespace(num_hidden_layers=6, num_local_experts=4, **kw))

    assert qwen(mlp_only_layers=[], decoder_sparse_step=1) == set(range(6))
    assert qwen(mlp_only_layers=[3], decoder_sparse_step=2) == {1, 5}
    ds = load_hf_config(tiny_deepseek_v2)
    assert deepseek_moe(SimpleNamespace(**{**vars(ds), "num_hidden_layers": 7, "first_k_dense_replace": 2,
                                           "moe_layer_freq": 2}))[1] == {2, 4, 6}
    for path in (tiny_qwen3_moe, tiny_deepseek_v2):  # layer 0 dense in both tiny configs
        layers = build_model(load_hf_config(path), 64).model.layers
        assert isinstance(layers[0].mlp, MLP) and isinstance(layers[1].mlp, SparseMoE)


def test_experts_in_a_dense_layer_are_an_error(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    import shutil

    bad = shutil.copytree(tiny_qwen3_moe, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [0, 1]}))
    with pytest.raises(ValueError, match="is not an MoE layer here"):
        _ours(bad)


def test_flags_the_model_cannot_honour(tiny_mixtral: Path, tiny_qwen3: Path, tiny_deepseek_v2: Path,
                                       tiny_llama: Path) -> None:
    for path in (tiny_mixtral, tiny_qwen3, tiny_deepseek_v2):
        cfg = load_hf_config(path)
        assert unsupported_flags(cfg, 1, 1, "auto") is None
        assert "--tensor-parallel-size 2" in unsupported_flags(cfg, 2, 1, "auto")
        assert "pass 1 for both" in unsupported_flags(cfg, 1, 2, "auto")
    assert unsupported_flags(load_hf_config(tiny_mixtral), 1, 1, "fp8") is None
    assert "--kv-cache-dtype fp8" in unsupported_flags(load_hf_config(tiny_deepseek_v2), 1, 1, "fp8")
    assert unsupported_flags(load_hf_config(tiny_llama), 1, 1, "fp8") is None


def test_unknown_deepseek_routing_is_refused(tiny_deepseek_v2: Path) -> None:
    cfg = load_hf_config(tiny_deepseek_v2)
    cfg.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="noaux_tc"):
        build_model(cfg, 64)


def test_name_sets_agree_with_the_classes() -> None:
    from lbd.engine.config.architectures import ARCHITECTURES, NO_FP8_KV_CACHE, PARALLEL_ARCHITECTURES
    from lbd.engine.models import model_class

    for arch in ARCHITECTURES:
        cls = model_class(SimpleNamespace(architectures=[arch]))
        assert (arch in PARALLEL_ARCHITECTURES) == getattr(cls, "supports_parallel", False), arch
        assert (arch in NO_FP8_KV_CACHE) == (not getattr(cls, "supports_fp8_kv_cache", True)), arch
