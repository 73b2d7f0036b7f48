"""Tokenizer wrapper and incremental detokenizer (stop strings, hold-back, multi-byte text)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lbd.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXT = "Hello world, how are you today? Once upon a time: é, 中文 and 🙂 done."


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


def stream(tok: Tokenizer, ids: list[int], **kw) -> tuple[str, list[str], str | None, int]:
    """Feed ids one by one like the front end; return (text handed out, chunks, stop hit, tokens used)."""
    d = IncrementalDetokenizer(tok, tok.encode("Prompt:", False), **kw)
    chunks, stop, used = [], None, 0
    for i in ids:
        used += 1
        stop = d.add(i)
        chunks.append(d.take(final=stop is not None))
        if stop:
            break
    else:
        chunks.append(d.take(final=True))
    return "".join(chunks), chunks, stop, used


def test_incremental_equals_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, False)
    text, chunks, stop, used = stream(tok, ids)
    assert text == TEXT == tok.decode(ids)
    assert stop is None and used == len(ids)
    # multi-byte characters span several byte-level tokens: no chunk may carry a replacement character
    assert all("\ufffd" not in c for c in chunks)


def test_stop_string_trims_and_reports(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, False)
    text, _, stop, used = stream(tok, ids, stop=["upon", "zzz"])
    assert stop == "upon"
    assert text == "Hello world, how are you today? Once "
    assert used < len(ids)
    text, _, stop, _ = stream(tok, ids, stop=["upon"], include_stop=True)
    assert text == "Hello world, how are you today? Once upon"


def test_earliest_stop_wins_and_stop_spanning_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, False)
    text, _, stop, _ = stream(tok, ids, stop=["today", "how are"])
    assert (stop, text) == ("how are", "Hello world, ")
    # a stop string that only appears across many tokens, with a multi-byte character in it
    text, _, stop, _ = stream(tok, ids, stop=["é, 中"])
    assert stop == "é, 中" and text.endswith("time: ")


def test_hold_back_never_leaks_a_stop_prefix(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, False)
    _, chunks, stop, _ = stream(tok, ids, stop=["you today"])
    assert stop == "you today"
    handed = ""
    for c in chunks:
        handed += c
        assert "you today" not in handed
    assert handed == "Hello world, how are "


def test_no_stop_streams_without_hold_back(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", False)
    d = IncrementalDetokenizer(tok, [], stop=None)
    out = ""
    for i in ids:
        d.add(i)
        out += d.take()
    assert out == "Hello world"  # everything handed out before the final flush


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    ids = tok.encode("Hello", False) + [eos]
    assert stream(tok, ids)[0] == "Hello"
    assert stream(tok, ids, skip_special_tokens=False)[0] == "Hello<|im_end|>"


def test_out_of_vocab_token_decodes_to_nothing(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, [])
    assert d.add(10**7) is None
    assert d.take(final=True) == ""


def test_piece_bytes_are_exact_for_byte_level_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("中文 🙂", False)
    raw = b"".join(bytes(tok.piece(i)[1]) for i in ids)
    assert raw == "中文 🙂".encode()
    assert tok.piece(tok.eos_token_id) == ("<|im_end|>", list(b"<|im_end|>"))


def test_chat_template_and_errors(tiny_llama: Path, tmp_path: Path) -> None:
    tok = Tokenizer(tiny_llama)
    text = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False).endswith(
        "<|im_end|>\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer(tiny_llama, str(template)).render_chat([{"role": "user", "content": "x"}]) == "[x]"
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer(tiny_llama, raising).render_chat([{"role": "user", "content": "x"}])


def test_no_chat_template_is_an_error(tiny_llama: Path) -> None:
    tok = Tokenizer(tiny_llama)
    tok.hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        tok.render_chat([{"role": "user", "content": "x"}])


def test_tokenizer_module_does_not_import_torch(tiny_llama: Path) -> None:
    code = (f"import sys; from lbd.engine.tokenizer import Tokenizer; Tokenizer({str(tiny_llama)!r}); "
            "import lbd.engine.server.app, lbd.engine.launch; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
