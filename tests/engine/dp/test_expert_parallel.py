"""`python -m lbd.engine` serving each MoE/MLA family over real HTTP (one server per family, several checks
each): greedy completions equal transformers', chat streams agree with non-streamed chat, concurrent
requests are not crossed; and the flags a model cannot honour exit 2 before anything is served."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from support import EngineServer
from support.parity import hf_greedy

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v2_grouped"]
PROMPTS = [[5, 17, 99, 120, 33, 250, 7], list(range(40, 90)), [300, 2, 3]]


@pytest.fixture(scope="module", params=FAMILIES)
def served(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, EngineServer]]:
    path = request.getfixturevalue(f"tiny_{request.param}")
    log = tmp_path_factory.mktemp(f"serve-{request.param}") / "server.log"
    try:
        server = EngineServer(path, "--kv-cache-memory-bytes", "16MiB", "--served-model-name", "tiny",
                              log=log)
    except Exception as e:
        raise AssertionError(f"server failed to start: {e}\n{log.read_text(errors='replace')[-4000:]}") from e
    try:
        yield path, server
    finally:
        server.close()


def _client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_greedy_completions_equal_transformers(served: tuple[Path, EngineServer]) -> None:
    from lbd.engine.tokenizer import Tokenizer

    path, server = served
    client = _client(server)
    tok = Tokenizer(path)
    refs = hf_greedy(path, PROMPTS, [8] * len(PROMPTS))
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})
    for choice, ref in zip(sorted(out.choices, key=lambda c: c.index), refs, strict=True):
        assert choice.logprobs.tokens == [tok.piece(t)[0] for t in ref.tokens]
        assert choice.logprobs.token_logprobs == pytest.approx(ref.chosen, abs=1e-3)
    assert out.usage.completion_tokens == 8 * len(PROMPTS)
    if "deepseek" in path.name:
        assert "MLA KV cache: 320 bytes per token" in server.log_text()


def test_chat_stream_agrees_and_concurrent_requests_are_not_crossed(
        served: tuple[Path, EngineServer]) -> None:
    _, server = served
    client = _client(server)
    msgs = [{"role": "user", "content": "Hello, how are you today?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    chunks = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full.choices[0].message.content

    texts = ["Once upon a time", "def add(a, b):", "The capital of France is"]

    def one(text: str) -> str:
        r = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    alone = [one(t) for t in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        assert list(pool.map(one, texts)) == alone


def test_flags_the_model_cannot_honour_exit_2(tiny_deepseek_v2: Path) -> None:
    # (each refusal's message: test_moe_loading.test_flags_the_model_cannot_honour)
    argv = [sys.executable, "-m", "lbd.engine", "--model", str(tiny_deepseek_v2), "--kv-cache-dtype", "fp8"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "--kv-cache-dtype fp8: DeepseekV2ForCausalLM keeps an MLA latent cache" in run.stderr
