"""Reading a new prompt's first blocks from its head (lbd.router.kv.cold, tokenize.RouterTokenizer.head): the
head ends at a pre-tokenizer boundary, so it tokenizes to a prefix of the whole text's ids; tokenizers where
that fails are found at load and keep waiting for the whole text. Real tokenizers (the default model's and
one trained here without a pre-tokenizer); no server. ~1 s."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, trainers

from lbd.engine.config.model_files import converted_path, default_gguf
from lbd.engine.loader import resolve_model
from lbd.router.kv.cold import HEAD_CHARS, ColdStart, estimate_tokens
from lbd.router.kv.tokenize import RouterTokenizer, load_local


def default_tokenizer() -> RouterTokenizer:
    folder = converted_path(default_gguf())
    return load_local(str(folder if (folder / "tokenizer.json").exists() else resolve_model(None)))


def test_head_cuts_at_a_single_space_between_words() -> None:
    head = RouterTokenizer.head
    assert head("hello world  foo bar", 12) == "hello"  # not inside the double space
    assert head("hello world foo", 13) == "hello world"
    assert head("a b", 10) == "a"
    assert head("abc", 10) is None and head(" abc", 10) is None  # no space with a word on both sides
    assert head("x \ty z", 6) == "x \ty"


def test_heads_tokenize_to_a_prefix_of_the_whole_text() -> None:
    tok = default_tokenizer()
    assert tok.by_heads
    rnd = random.Random(7)
    words = ["river", "sea,", "12345", "o'clock", "(naïve)", "snake_case", "e-mail@x.org", "--", "3.14"]
    for _ in range(30):
        text = " ".join(rnd.choice(words) for _ in range(400))
        whole = tok.rust.encode(text, add_special_tokens=False).ids
        head = tok.head(text, rnd.randrange(20, HEAD_CHARS))
        assert head is not None
        ids = tok.rust.encode(head, add_special_tokens=False).ids
        assert whole[: len(ids)] == ids


def test_a_tokenizer_that_merges_across_spaces_is_not_read_by_heads() -> None:
    """BPE without a pre-tokenizer learns merges across spaces ("ab cd" one token): a head may then end
    inside a token of the whole text, so the router must not trust heads for it."""
    bpe = Tokenizer(models.BPE(unk_token="[UNK]"))
    bpe.train_from_iterator(["ab cd ab cd ab cd " * 50], trainers.BpeTrainer(special_tokens=["[UNK]"]))
    tok = RouterTokenizer(bpe.to_str(), {})
    assert tok.by_pieces and not tok.by_heads


def test_the_head_and_the_length_estimate_of_a_new_system_prompt() -> None:
    tok = default_tokenizer()
    system = " ".join(f"Rule {i}: answer briefly about rivers and lakes." for i in range(200))
    data = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]}
    plan = tok.plan_request(data)  # as the router first sees it: the system prompt's text is new
    assert plan is not None and plan.missing_chars > HEAD_CHARS
    got = ColdStart().head_ids(tok, plan)
    assert got is not None
    ids, _, head_chars = got
    first_new = next(i for i, p in enumerate(plan.pieces) if isinstance(p, str))
    before = sum(len(p) for p in plan.pieces[:first_new])
    known = sum(len(p) for p in plan.pieces if not isinstance(p, str))
    guess = estimate_tokens(plan, len(ids) - before, head_chars, known)
    tok.fill(plan, tok.encode_missing(plan, off_loop=True))
    whole = tok.assemble(plan)
    assert head_chars <= HEAD_CHARS and len(ids) > before + 8 * 16  # 8 blocks: footprint.ROOT_BLOCKS
    assert whole[: len(ids)] == ids
    assert abs(guess - len(whole)) < 0.1 * len(whole), (guess, len(whole))
