"""The internal key's signatures (lbd.common.internal_key): bound to one request body, fresh, used once;
and the key proof that replaced the published key id (nothing a guess can be checked against offline)."""

from __future__ import annotations

import time

from lbd.common.internal_key import SKEW_S, VALID_S, IdsSigner, ReplayGuard, body_digest

IDS, FP = b"[1,2,3,4]", "ab12"


def test_a_signature_is_good_for_its_body_once_within_its_validity() -> None:
    signer, other = IdsSigner("internal"), IdsSigner("another")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    digest = body_digest(body)
    assert digest == body_digest(dict(reversed(list(body.items()))))  # key order does not matter
    now = time.time()
    sig = signer.sign(IDS, FP, digest, now)
    # another key, other ids, another fingerprint, another body: not ours
    assert other.verify(IDS, FP, digest, sig, now) == "signature"
    assert signer.verify(b"[1,2,3,5]", FP, digest, sig, now) == "signature"
    assert signer.verify(IDS, "cd34", digest, sig, now) == "signature"
    for changed in ({**body, "max_tokens": 6}, {**body, "messages": []}, {**body, "model": "n"}):
        assert signer.verify(IDS, FP, body_digest(changed), sig, now) == "signature"
    # its own body: once
    assert signer.verify(IDS, FP, digest, sig, now) is None
    assert signer.verify(IDS, FP, digest, sig, now + 1) == "replayed"
    # a minute (plus the skew) later, or from a clock too far ahead: expired
    late = signer.sign(IDS, FP, digest, now - VALID_S - SKEW_S - 1)
    ahead = signer.sign(IDS, FP, digest, now + SKEW_S + 1)
    assert signer.verify(IDS, FP, digest, late, now) == "expired"
    assert signer.verify(IDS, FP, digest, ahead, now) == "expired"
    within = signer.sign(IDS, FP, digest, now - VALID_S + 1)
    assert signer.verify(IDS, FP, digest, within, now) is None
    for bad in (None, "", "0" * 64, "1.2", "x.y.z", f"{int(now * 1000)}.a b.{'0' * 64}", sig + "0"):
        assert signer.verify(IDS, FP, digest, bad, now) == "signature", bad


def test_the_replay_guard_forgets_only_what_expired_or_refuses_what_it_forgot() -> None:
    guard = ReplayGuard(capacity=3)
    now = 1_000_000_000
    for i in range(3):
        assert guard.first_use(f"n{i}", now + i, now + i)
    assert not guard.first_use("n1", now + 1, now + 3)  # seen
    assert guard.first_use("n3", now + 3, now + 3)  # full: n0 forgotten early, so its stamp is the floor
    assert guard.floor_ms == now and not guard.first_use("n9", now, now + 3)
    horizon = now + int((VALID_S + SKEW_S) * 1000) + 10
    assert guard.first_use("n10", horizon, horizon) and len(guard) == 1  # the expired ones went


def test_a_key_proof_says_only_whether_it_was_made_with_the_key() -> None:
    signer, guess = IdsSigner("internal"), IdsSigner("a guess")
    proof = signer.prove()
    assert signer.check_proof(proof) and not guess.check_proof(proof)
    assert not signer.check_proof(guess.prove())
    assert not signer.check_proof(signer.prove(time.time() - VALID_S - SKEW_S - 1))
    for bad in (None, "", "1.2", "x.y.z", proof + "0"):
        assert not signer.check_proof(bad)
    assert not hasattr(signer, "key_id")  # nothing of the key is published for offline checks
