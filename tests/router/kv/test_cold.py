"""Reading a new prompt's first blocks from its head (lbd.router.kv.cold, tokenize.RouterTokenizer.head): the
head ends at a pre-tokenizer boundary, so it tokenizes to a prefix of the whole text's ids; tokenizers where
that fails are found at load and keep waiting for the whole text. Real tokenizers (the default model's and
one trained here without a pre-tokenizer); no server. ~1 s."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, models, trainers

from lbd.router.kv.cold import HEAD_CHARS, ColdStart, head_sizes
from lbd.router.kv.tokenize import RouterTokenizer
from support import default_router_tokenizer as default_tokenizer


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
    cold = ColdStart()
    first_new = next(i for i, p in enumerate(plan.pieces) if isinstance(p, str))
    before = sum(len(p) for p in plan.pieces[:first_new])
    sizes = head_sizes(before, [16])
    short, long = cold.heads(tok, plan, [16])  # the short head, then the long one
    known = sum(len(p) for p in plan.pieces if not isinstance(p, str))
    guess = cold.estimate_tokens(plan, len(long[0]) - before, long[2], known)
    tok.fill(plan, tok.encode_missing(plan, off_loop=True))
    whole = tok.assemble(plan)
    # the short head completes the block that reaches into the new text; the long one the prefix's name
    assert short[2] <= sizes[0] < 160 and len(short[0]) >= 16 > before
    assert long[2] <= HEAD_CHARS and len(long[0]) > before + 8 * 16  # 8 blocks: footprint.ROOT_BLOCKS
    assert whole[: len(short[0])] == short[0] and whole[: len(long[0])] == long[0]
    assert abs(guess - len(whole)) < 0.1 * len(whole), (guess, len(whole))


def test_the_length_estimate_learns_the_characters_per_token_of_tokenized_texts() -> None:
    """A short head is a poor sample of a text's characters per token; the texts tokenized lately are not."""
    tok = default_tokenizer()
    # each opens with codes (a few characters a token), then prose (several)
    texts = [" ".join(f"{t}.{i}:" for i in range(40)) + " " +
             " ".join(f"Tenant {t} rule {i}: reply in kind, briefly." for i in range(150)) for t in range(3)]
    plans = [tok.plan_request({"messages": [{"role": "system", "content": x}]}) for x in texts]
    cold = ColdStart()
    for plan in plans[:2]:
        assert plan is not None
        cold._learn_ratio(plan.missing, tok.encode_missing(plan, off_loop=True))
    plan = plans[2]
    assert plan is not None
    got = next(cold.heads(tok, plan, [16]))  # the short head
    known = sum(len(p) for p in plan.pieces if not isinstance(p, str))
    first_new = next(i for i, p in enumerate(plan.pieces) if isinstance(p, str))
    before = sum(len(p) for p in plan.pieces[:first_new])
    guess = cold.estimate_tokens(plan, len(got[0]) - before, got[2], known)
    naive = ColdStart().estimate_tokens(plan, len(got[0]) - before, got[2], known)  # from the head alone
    tok.fill(plan, tok.encode_missing(plan, off_loop=True))
    whole = len(tok.assemble(plan))
    assert abs(guess - whole) < 0.05 * whole < abs(naive - whole), (guess, naive, whole)
