"""tiercache.exact.answer_ids: an answer id names its entry for its tenant only, tells nothing,
and cannot be forged or altered."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import select
import signal
import threading
import traceback
from collections.abc import Callable

import pytest

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact import answer_ids
from tiercache.exact.answer_ids import (
    BASE_MODEL_TAG,
    ID_CHARS,
    PREFIX,
    AnswerIds,
    AnswerRef,
    ServedAs,
    adapter_tag,
)

SECRET = bytes(range(32))
DIGEST = hashlib.sha256(b"an answer").hexdigest()
OTHER_DIGEST = hashlib.sha256(b"another answer").hexdigest()


def test_an_id_opens_to_what_it_names_for_its_tenant() -> None:
    ids = AnswerIds(SECRET)
    ref = AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.875, 1_700_000_000.5, score=0.9375)
    opened = ids.open(ids.issue(ref, "scope-a"), "scope-a")
    assert opened == dataclasses.replace(ref, adapter=BASE_MODEL_TAG)
    own = ids.open(ids.issue(AnswerRef(OTHER_DIGEST, ServedAs.OWN), "scope-a"), "scope-a")
    assert (own.digest, own.served, own.similarity) == (OTHER_DIGEST, ServedAs.OWN, 0.0)
    assert own.issued_s > 1_700_000_000  # stamped at issue when the ref does not say
    hit = ids.open(ids.issue(AnswerRef(OTHER_DIGEST, ServedAs.CACHED), "scope-a"), "scope-a")
    assert hit.served is ServedAs.CACHED and hit.served.kind == own.served.kind == "own"


def test_an_id_opens_for_no_other_tenant_and_no_other_secret() -> None:
    ids = AnswerIds(SECRET)
    answer_id = ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a")
    with pytest.raises(Forbidden):
        ids.open(answer_id, "scope-b")
    with pytest.raises(Forbidden):
        AnswerIds(bytes(32)).open(answer_id, "scope-a")


def test_every_id_has_one_length_and_repeats_tell_nothing() -> None:
    ids = AnswerIds(SECRET)
    hit = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9), "scope-a")
    again = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.9), "scope-a")
    own = ids.issue(AnswerRef(OTHER_DIGEST, ServedAs.OWN), "scope-a")
    assert len(hit) == len(again) == len(own) == ID_CHARS
    assert hit != again  # one answer served twice: unrelated ids
    assert DIGEST not in hit and DIGEST[:16] not in hit


def test_an_id_issued_from_a_digest_is_the_refs_and_each_scope_keeps_its_own() -> None:
    """`issue_digest` (an exact hit's id, its parts kept per answer, scope and adapter) opens
    as `issue` of the same ref does, for its own scope and adapter only, however many ids of
    other answers were issued in between (the kept parts forgotten when full)."""
    ids = AnswerIds(SECRET)
    first = ids.issue_digest(DIGEST, ServedAs.CACHED, "scope-a", "caps")
    for i in range(answer_ids._KNOWN_PARTS + 1):
        ids.issue_digest(hashlib.sha256(str(i).encode()).hexdigest(), ServedAs.OWN, "scope-b")
    for answer_id in (first, ids.issue_digest(DIGEST, ServedAs.CACHED, "scope-a", "caps")):
        opened = ids.open(answer_id, "scope-a")
        assert (opened.digest, opened.served, opened.similarity, opened.score) == (
            DIGEST,
            ServedAs.CACHED,
            0.0,
            0.0,
        )
        assert opened.adapter == adapter_tag("caps") and opened.issued_s > 1_700_000_000
        with pytest.raises(Forbidden):
            ids.open(answer_id, "scope-b")
    other = ids.open(ids.issue_digest(DIGEST, ServedAs.OWN, "scope-b"), "scope-b")
    assert other.adapter == BASE_MODEL_TAG and other.served is ServedAs.OWN
    with pytest.raises(ValueError, match="hex"):
        ids.issue_digest("not hex", ServedAs.CACHED, "scope-a")


def test_an_altered_id_is_refused_at_every_byte() -> None:
    ids = AnswerIds(SECRET)
    answer_id = ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a")
    raw = bytearray(base64.urlsafe_b64decode(answer_id[len(PREFIX) :] + "=="))
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 0x01
        text = PREFIX + base64.urlsafe_b64encode(bytes(flipped)).rstrip(b"=").decode()
        with pytest.raises(Forbidden):
            ids.open(text, "scope-a")


def _old_id(prefix: str, body_format: str, *fields: object, scope: str = "scope-a") -> str:
    """An id in a format issued before (still opened): `fields` packed and sealed as it was."""
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from tiercache.exact.keys import derive_key

    body = struct.pack(body_format, *fields)
    nonce = os.urandom(12)
    aead = AESGCM(derive_key(SECRET, "answer ids"))
    sealed = nonce + aead.encrypt(nonce, body, b"tiercache answer id\x00" + scope.encode())
    return prefix + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()


def test_an_id_has_one_spelling() -> None:
    """The last base64url character may carry unused bits; an id with any of them set decodes
    to the same bytes, and is refused: every character of an id is checked. Today's ids are a
    multiple of 3 bytes (no unused bits); the format before them (a2., still opened) is not."""
    ids = AnswerIds(SECRET)
    answer_id = ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a")
    assert len(answer_id[len(PREFIX) :]) % 4 == 0  # no unused bits: one spelling by itself
    old = _old_id("a2.", ">B32sffd", 0, bytes.fromhex(DIGEST), 0.0, 0.0, 1_700_000_000.5)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    last = alphabet.index(old[-1])
    unused = (4 - len(old[3:]) % 4) % 4 * 2  # bits the decoder drops
    assert unused > 0
    spellings = [old[:-1] + alphabet[last | bit] for bit in range(1, 1 << unused)]
    for other in spellings:
        with pytest.raises(InvalidRequest):
            ids.open(other, "scope-a")
    assert ids.open(old, "scope-a").digest == ids.open(answer_id, "scope-a").digest == DIGEST


@pytest.mark.parametrize(
    "text",
    ["", "a1.", "not an id", DIGEST, "a9." + "A" * (ID_CHARS - 3), PREFIX + "*" * (ID_CHARS - 3)],
)
def test_what_is_not_an_id_is_an_invalid_request(text: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        AnswerIds(SECRET).open(text, "scope-a")
    assert not isinstance(caught.value, Forbidden)


def test_a_digest_that_is_not_32_hex_bytes_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        AnswerIds(SECRET).issue(AnswerRef("abc", ServedAs.OWN), "scope-a")


def test_an_id_names_its_requests_adapter_for_keys_limited_to_some() -> None:
    """A key limited to some adapters may judge answers of those and of the base model only;
    the id says which adapter (sealed: the name is not readable from it)."""
    ids = AnswerIds(SECRET)
    brief = ids.open(ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a", "brief"), "scope-a")
    base = ids.open(ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a"), "scope-a")
    assert brief.adapter == adapter_tag("brief") != adapter_tag("caps")
    assert base.adapter == BASE_MODEL_TAG
    assert brief.adapter_allowed(None) and brief.adapter_allowed(frozenset({"caps", "brief"}))
    assert not brief.adapter_allowed(frozenset({"caps"}))
    assert not brief.adapter_allowed(frozenset())
    assert base.adapter_allowed(frozenset({"caps"})) and base.adapter_allowed(frozenset())
    assert len(ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a", "brief")) == ID_CHARS


def test_an_id_of_the_format_before_the_adapter_opens_for_unlimited_keys_only() -> None:
    old = _old_id("a2.", ">B32sffd", 0, bytes.fromhex(DIGEST), 0.0, 0.5, 1_700_000_000.5)
    assert len(old) != ID_CHARS
    opened = AnswerIds(SECRET).open(old, "scope-a")
    assert opened == AnswerRef(DIGEST, ServedAs.OWN, 0.0, 1_700_000_000.5, 0.5, None)
    assert opened.adapter_allowed(None)
    assert not opened.adapter_allowed(frozenset({"brief"}))  # cannot tell: refused


def test_an_id_of_the_format_before_the_score_still_opens() -> None:
    """Ids handed out before the trust score joined the format (prefix a1., no score) open as
    they did, their score 0.0 (nothing for the trust gate to learn at)."""
    import os
    import struct

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from tiercache.exact.keys import derive_key

    body = struct.pack(">B32sfd", 1, bytes.fromhex(DIGEST), 0.875, 1_700_000_000.5)
    nonce = os.urandom(12)
    aead = AESGCM(derive_key(SECRET, "answer ids"))
    sealed = nonce + aead.encrypt(nonce, body, b"tiercache answer id\x00scope-a")
    old = "a1." + base64.urlsafe_b64encode(sealed).rstrip(b"=").decode()
    assert len(old) != ID_CHARS
    opened = AnswerIds(SECRET).open(old, "scope-a")
    assert opened == AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.875, 1_700_000_000.5, 0.0)
    with pytest.raises(Forbidden):
        AnswerIds(SECRET).open(old, "scope-b")


def _nonce(answer_id: str) -> bytes:
    return base64.urlsafe_b64decode(answer_id[len(PREFIX) :] + "==")[: answer_ids.NONCE_BYTES]


def test_nonces_are_drawn_in_batches_and_never_repeat() -> None:
    drawn: list[int] = []

    def random_bytes(n: int) -> bytes:
        drawn.append(n)
        return os.urandom(n)

    ids = AnswerIds(SECRET, random_bytes)
    per_batch = answer_ids.NONCES_PER_BATCH
    issued = [ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a") for _ in range(per_batch + 1)]
    assert len({_nonce(i) for i in issued}) == per_batch + 1  # every id its own nonce
    batch_bytes = answer_ids.NONCE_BYTES * per_batch
    assert drawn == [batch_bytes, batch_bytes]  # one draw per batch, not one per id


def _in_a_child(work: Callable[[], bytes], timeout_s: float = 20.0) -> bytes:
    """`work()` run in a process forked from this one; what it returned. The child is killed by
    an alarm if it hangs (a lock held across the fork would deadlock it), and any failure in it
    fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(int(timeout_s))
            os.close(read_end)
            os.write(write_end, work())
            code = 0
        except BaseException:  # noqa: BLE001 - reported to the parent by the exit code
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], timeout_s + 5)
        data = pipe.read() if ready else b""
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child failed or hung"
    return data


def test_a_forked_child_never_hands_out_its_parents_next_nonces() -> None:
    """A child forked mid-batch would otherwise continue from the parent's offset and issue
    the very nonces the parent issues next (AES-GCM nonce reuse under one key)."""
    ids = AnswerIds(SECRET)
    ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a")  # a batch drawn, mid-way

    def next_three() -> bytes:
        return b"".join(
            _nonce(ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a")) for _ in range(3)
        )

    def in_child() -> bytes:
        assert ids._nonces._batch == b""  # the fork hook emptied the child's batch
        return next_three()

    child = _in_a_child(in_child)
    parent = next_three()
    size = answer_ids.NONCE_BYTES
    assert len(child) == len(parent) == 3 * size
    child_nonces = {child[i : i + size] for i in range(0, len(child), size)}
    assert not child_nonces & {parent[i : i + size] for i in range(0, len(parent), size)}


def test_a_child_forked_while_another_thread_held_the_lock_still_issues() -> None:
    ids = AnswerIds(SECRET)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with ids._nonces._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        child = _in_a_child(lambda: ids.issue(AnswerRef(DIGEST, ServedAs.OWN), "scope-a").encode())
    finally:
        release.set()
        holder.join(10)
    assert ids.open(child.decode(), "scope-a").digest == DIGEST
