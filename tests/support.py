"""Shared helpers for tests and benchmarks: tiny checkpoints, free ports, real server processes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin. Hello world, how are you today?",
    "Once upon a time there was a tiny model that learned to count: one two three four five six seven.",
    "def add(a, b):\n    return a + b\n# numbers 0123456789 and symbols !?.,;:-_()[]{}<>",
]


def make_tokenizer(path: Path, vocab_size: int = 384):
    """A small byte-level BPE tokenizer (any text encodes) with ChatML specials, saved to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(path)
    return fast


def make_tiny_llama(path: Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 128, max_pos: int = 512, seed: int = 0, tie: bool = False,
                    dtype: str = "float32") -> Path:
    """A random-weight Llama checkpoint (config.json + model.safetensors + tokenizer) in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=tie,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    # Random init gives near-uniform logits (many near-ties); a larger scale makes greedy choices crisp.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return path


def _save_tiny(path: Path, make_config, model_cls_name: str, seed: int) -> Path:
    """A random-weight checkpoint + tokenizer: ``make_config(tokenizer)`` builds transformers' config."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(path)
    torch.manual_seed(seed)
    cfg = make_config(tok)
    model = getattr(transformers, model_cls_name)(cfg).float()
    # Crisp weights (clear greedy choices), routers crisper still (no near-tied expert choices), and norm
    # weights away from 1 (a norm applied to the wrong tensor shows).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.3)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
            elif "norm" in name:
                p.uniform_(0.6, 1.4)
    model.save_pretrained(path)
    return path


def _common(tok, layers: int, hidden: int, heads: int, max_pos: int) -> dict:
    return dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                max_position_embeddings=max_pos, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rms_norm_eps=1e-6, tie_word_embeddings=False)


def make_tiny_mixtral(path: Path, *, layers: int = 2, hidden: int = 64, experts: int = 4, seed: int = 0,
                      max_pos: int = 512) -> Path:
    """Mixtral: 4 heads (2 KV), top-2 of ``experts`` experts of 96 in every layer."""
    from transformers import MixtralConfig

    return _save_tiny(path, lambda tok: MixtralConfig(
        **_common(tok, layers, hidden, 4, max_pos), num_key_value_heads=2, intermediate_size=96,
        num_local_experts=experts, num_experts_per_tok=2, rope_theta=10000.0), "MixtralForCausalLM", seed)


def make_tiny_qwen3(path: Path, *, layers: int = 2, seed: int = 0, max_pos: int = 512) -> Path:
    """Dense Qwen3: hidden 64, 4 heads (2 KV) of head_dim 32 (not hidden / heads), q/k norms."""
    from transformers import Qwen3Config

    return _save_tiny(path, lambda tok: Qwen3Config(
        **_common(tok, layers, 64, 4, max_pos), num_key_value_heads=2, head_dim=32, intermediate_size=128),
        "Qwen3ForCausalLM", seed)


def make_tiny_qwen3_moe(path: Path, *, layers: int = 2, experts: int = 8, seed: int = 0, max_pos: int = 512,
                        norm_topk_prob: bool = True, mlp_only_layers: tuple[int, ...] = (0,)) -> Path:
    """Qwen3-MoE: q/k norms, top-2 of ``experts`` experts of 32; ``mlp_only_layers`` dense (96)."""
    from transformers import Qwen3MoeConfig

    return _save_tiny(path, lambda tok: Qwen3MoeConfig(
        **_common(tok, layers, 64, 4, max_pos), num_key_value_heads=2, head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, num_experts=experts, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers)), "Qwen3MoeForCausalLM", seed)


def make_tiny_deepseek_v2(path: Path, *, layers: int = 2, experts: int = 8, seed: int = 0, max_pos: int = 512,
                          q_lora_rank: int | None = None, topk_method: str = "greedy",
                          yarn: bool = False) -> Path:
    """DeepSeek-V2 with MLA (kv_lora_rank 32, nope 16 + rope 8, v 16; ``q_lora_rank`` None as in V2-Lite),
    layer 0 dense, then top-2 of ``experts`` routed experts + 1 shared (routed_scaling_factor 1.5).
    ``topk_method="group_limited_greedy"``: 4 groups, the best 2 compete. ``yarn``: yarn rope (factor 4
    over 128 original positions) with mscale 0.9 / mscale_all_dim 0.7, which also scales the softmax."""
    from transformers import DeepseekV2Config

    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9,
                "mscale_all_dim": 0.7}
    groups = dict(n_group=4, topk_group=2) if topk_method == "group_limited_greedy" else {}
    return _save_tiny(path, lambda tok: DeepseekV2Config(
        **_common(tok, layers, 64, 4, max_pos), intermediate_size=96, moe_intermediate_size=32,
        n_routed_experts=experts, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        routed_scaling_factor=1.5, topk_method=topk_method, rope_parameters=rope, **groups),
        "DeepseekV2ForCausalLM", seed)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P such that P .. P+count-1 are free now (a supervisor's ranks take consecutive ports).

    Chosen below Linux's ephemeral range (32768+), so no outgoing connection can take one of them between
    this check and the server's bind.
    """
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports found")


def wait_http(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
              ok: tuple[int, ...] = (200,)) -> None:
    """Poll ``url`` until it answers one of ``ok``; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code in ok:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last!r})")


def spawn(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start a child in its own process group, output to ``log`` (or inherited)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    out = open(log, "ab") if log else None  # noqa: SIM115 - closed by the OS with the child
    return subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM the child's group, then SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode


class EngineServer:
    """A real `python -m engine` process on a free loopback port."""

    def __init__(self, model: Path | str | None, *args: str, env: dict[str, str] | None = None,
                 log: Path | None = None, ready_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "engine", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if model is not None:
            argv += ["--model", str(model)]
        self.log = log
        self.proc = spawn(argv, env=env, log=log)
        try:
            wait_http(self.base_url + "/health", timeout=ready_timeout, proc=self.proc)
        except Exception:
            self.close()
            raise

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def close(self) -> int | None:
        return stop(self.proc)

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def engine_server(model: Path | str | None, *args: str, **kw) -> Iterator[EngineServer]:
    server = EngineServer(model, *args, **kw)
    try:
        yield server
    finally:
        server.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labelpart = head.partition("{")
        if metric != name:
            continue
        pairs = dict(p.split("=", 1) for p in labelpart.rstrip("}").split(",") if "=" in p)
        pairs = {k: json.loads(v) for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def tree_usage(*pids: int) -> tuple[float, int]:
    """(CPU seconds user+system, RSS bytes) so far of these processes and all their descendants."""
    import psutil

    cpu, rss = 0.0, 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
                cpu += t.user + t.system
                rss += proc.memory_info().rss
            except psutil.Error:
                pass
    return cpu, rss


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks stop the servers a script started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def make_certs(folder: Path, *hosts: str) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for ``hosts`` (default 127.0.0.1, localhost), made here with
    trustme: (ca.pem, cert.pem, key.pem)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*(hosts or ("127.0.0.1", "localhost")))
    folder.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in cert.cert_chain_pems[1:]:
        with open(cert_path, "ab") as f:
            f.write(extra.bytes())
    cert.private_key_pem.write_to_path(str(key_path))
    return ca_path, cert_path, key_path


class RouterServer:
    """A real `lbd route` process on a free loopback port (synchronous helpers, for e2e tests)."""

    def __init__(self, *args: str, log: Path | None = None, env: dict[str, str] | None = None,
                 scheme: str = "http", verify: object = True) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = log
        self.verify = verify
        argv = [sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = spawn(argv, env=env, log=log)

    def wait_ready(self, timeout: float = 60.0, path: str = "/readyz") -> RouterServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2.0, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router not ready: {self.log_text()[-3000:]}")

    def status(self, **kw) -> dict:
        return httpx.get(self.url + "/router/status", timeout=5.0, verify=self.verify, **kw).json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def close(self) -> int | None:
        return stop(self.proc)
