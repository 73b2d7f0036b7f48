"""return_token_ids: a choice's ids are reported with their text, held back with it (a possible stop string),
text goes out in whole tokens, and everything is released when the choice finishes."""

from __future__ import annotations

from types import SimpleNamespace

from lbd.engine.server.sequence import Delta
from lbd.engine.server.token_ids import EmittedIds
from lbd.wire.core_messages import TokenLogprobs


def delta(seq: SimpleNamespace, text: str, ids: list[int], pieces: list[str],
          finished: bool = False) -> Delta:
    """``pieces``: each token's text; the sequence's text grows by them (``text``: what the detokenizer let
    go of)."""
    offsets = []
    for p in pieces:
        offsets.append(seq.detok.length)
        seq.detok.length += len(p)
    return Delta(seq, text, ids, None, offsets, finished)  # type: ignore[arg-type]


def take(e: EmittedIds, d: Delta) -> tuple[str, list[int]]:
    r = e.take(d)
    return r.text, r.token_ids


def seq() -> SimpleNamespace:
    return SimpleNamespace(index=0, detok=SimpleNamespace(length=0))


def test_ids_go_out_with_their_text() -> None:
    s, e = seq(), EmittedIds(1)
    assert take(e, delta(s, "ab", [1, 2], ["a", "b"])) == ("ab", [1, 2])
    assert take(e, delta(s, "c", [3], ["c"])) == ("c", [3])


def test_held_back_text_holds_back_its_tokens() -> None:
    s, e = seq(), EmittedIds(1)
    assert take(e, delta(s, "ab", [1, 2, 3], ["ab", "S", "T"])) == ("ab", [1])  # "ST": a stop string's start?
    assert take(e, delta(s, "", [4], ["x"])) == ("", [])
    assert take(e, delta(s, "STx", [5], ["y"])) == ("STx", [2, 3, 4])
    assert take(e, delta(s, "y", [], [], finished=True)) == ("y", [5])


def test_a_token_s_text_is_never_sent_in_part() -> None:
    s, e = seq(), EmittedIds(1)
    assert take(e, delta(s, "aG", [1, 2], ["a", "Ger"])) == ("a", [1])  # "er" held back: "G" waits with it
    assert take(e, delta(s, "er", [3], ["man"])) == ("Ger", [2])
    assert take(e, delta(s, "man", [], [], finished=True)) == ("man", [3])


def test_a_token_without_text_of_its_own_waits_for_the_next() -> None:
    s, e = seq(), EmittedIds(1)
    assert take(e, delta(s, "a", [1, 2], ["a", ""])) == ("a", [1])  # 2: half a character
    assert take(e, delta(s, "é", [3], ["é"])) == ("é", [2, 3])


def test_finishing_releases_everything() -> None:
    s, e = seq(), EmittedIds(1)
    assert take(e, delta(s, "", [1, 2], ["S", "T"])) == ("", [])
    assert take(e, delta(s, "ST", [], [], finished=True)) == ("ST", [1, 2])


def test_logprobs_go_out_with_their_tokens() -> None:
    s, e = seq(), EmittedIds(1)
    lps = [TokenLogprobs(token_logprob=-1.0, top_ids=[1], top_logprobs=[-1.0]),
           TokenLogprobs(token_logprob=-2.0, top_ids=[2], top_logprobs=[-2.0])]
    d = delta(s, "a", [1, 2], ["a", ""])
    d.logprobs = lps
    r = e.take(d)
    assert (r.token_ids, r.logprobs, r.offsets) == ([1], lps[:1], [0])
    r = e.take(delta(s, "é", [], [], finished=True))
    assert (r.token_ids, r.logprobs, r.offsets) == ([2], lps[1:], [1])
