"""Stage seals (tiercache.stages.seal): what one hop seals, the next verifies; anything unsealed,
altered, moved between fields or hops, or sealed under another deployment's secret is Forbidden."""

from __future__ import annotations

import hmac
import struct

import numpy as np
import pytest

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import Digest, derive_key
from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import Envelope, Freshness, ReceivedEnvelope, seal_of
from tiercache.stages.seal import (
    ANSWER_LABEL,
    ANSWER_TENSORS,
    ENGINE_INPUTS,
    ENGINE_LABEL,
    SEAL_CHARS,
    Sealer,
    check_tensors,
    float_bytes,
    seal_tensors,
)
from tiercache.vocabulary import CacheStatus

SEALER = Sealer.from_secret(b"s" * 32)
OTHER = Sealer.from_secret(b"t" * 32)  # another deployment's secret
FRESH = Freshness(float("inf"))  # seals only here: the envelopes are built at import
MISS = Envelope(
    request=GenerationRequest(prompt="what is a cache?", tenant_scope="a" * 64),
    status=CacheStatus.MISS,
    digest=Digest("d" * 64),
    write_back=True,
)


def test_a_sealed_envelope_opens_with_the_same_secret_only() -> None:
    data = MISS.seal(SEALER)
    assert len(seal_of(data)) == SEAL_CHARS
    assert Envelope.open(data, SEALER, FRESH) == MISS
    with pytest.raises(Forbidden, match="does not verify"):
        Envelope.open(data, OTHER, FRESH)


def test_an_unsealed_envelope_is_forbidden() -> None:
    with pytest.raises(Forbidden, match="does not verify"):
        Envelope.open(MISS.encode(), SEALER, FRESH)  # the bare JSON: its first 64 bytes are no seal
    with pytest.raises(InvalidRequest, match="is required"):
        Envelope.open(b"", SEALER, FRESH)


def test_an_altered_envelope_is_forbidden() -> None:
    data = MISS.seal(SEALER)
    forged = data.replace(b'"write_back":true', b'"write_back":false')
    assert forged != data
    with pytest.raises(Forbidden):
        Envelope.open(forged, SEALER, FRESH)
    other_tenant = data.replace(b"a" * 64, b"b" * 64)
    with pytest.raises(Forbidden):
        Envelope.open(other_tenant, SEALER, FRESH)


def test_the_envelope_seal_binds_the_exact_hits_text() -> None:
    hit = Envelope(request=MISS.request, status=CacheStatus.EXACT, digest=MISS.digest)
    data = hit.seal(SEALER, "the cached answer")
    assert Envelope.open(data, SEALER, FRESH, "the cached answer") == hit
    with pytest.raises(Forbidden):
        Envelope.open(data, SEALER, FRESH, "a forged answer")
    with pytest.raises(Forbidden):  # an exact hit's envelope cannot pass as a miss's
        ReceivedEnvelope(data, SEALER, FRESH).get()


def test_the_envelope_seal_binds_the_exact_hits_token_counts() -> None:
    hit = Envelope(request=MISS.request, status=CacheStatus.EXACT, digest=MISS.digest)
    data = hit.seal(SEALER, "the cached answer", (31, 12, 1))
    assert Envelope.open(data, SEALER, FRESH, "the cached answer", (31, 12, 1)) == hit
    assert ReceivedEnvelope(data, SEALER, FRESH, "the cached answer", (31, 12, 1)).get() == hit
    for forged in ((31, 13, 1), (0, 0, 0), (12, 31, 1), (31, 12, 0)):
        with pytest.raises(Forbidden):
            Envelope.open(data, SEALER, FRESH, "the cached answer", forged)
    # unknown counts seal as before counts existed: the text alone
    plain = hit.seal(SEALER, "the cached answer")
    assert plain == hit.seal(SEALER, "the cached answer", (0, 0, 0))


def test_a_seal_is_bound_to_its_hop_its_fields_and_the_envelope() -> None:
    vector = np.arange(4, dtype=np.float32)
    values = {
        "ANSWER_TEXT": "answer",
        "ANSWER_STATUS": "semantic",
        "SIMILARITY": float_bytes(0.93),
        "EMBEDDING": vector,
    }
    bound = seal_of(MISS.seal(SEALER))
    seal = seal_tensors(SEALER, ANSWER_LABEL, ANSWER_TENSORS, values, bound=bound)
    check_tensors(SEALER, seal, ANSWER_LABEL, ANSWER_TENSORS, values, bound=bound, what="answer")
    cases = [
        ({**values, "ANSWER_TEXT": "forged"}, ANSWER_LABEL, bound),
        ({**values, "ANSWER_STATUS": "exact"}, ANSWER_LABEL, bound),
        ({**values, "SIMILARITY": float_bytes(0.99)}, ANSWER_LABEL, bound),
        ({**values, "EMBEDDING": vector + 1}, ANSWER_LABEL, bound),
        # the same bytes moved from one field into the next
        ({**values, "ANSWER_TEXT": "answersemantic", "ANSWER_STATUS": ""}, ANSWER_LABEL, bound),
        (values, ENGINE_LABEL, bound),  # another hop's label
        (values, ANSWER_LABEL, "0" * SEAL_CHARS),  # another request's envelope
    ]
    for forged, label, envelope_seal in cases:
        with pytest.raises(Forbidden, match="answer's seal does not verify"):
            check_tensors(
                SEALER, seal, label, ANSWER_TENSORS, forged, bound=envelope_seal, what="answer"
            )
    with pytest.raises(Forbidden, match="is not sealed"):
        check_tensors(SEALER, "", ANSWER_LABEL, ANSWER_TENSORS, values, bound=bound, what="x")


def test_an_omitted_tensor_seals_as_empty() -> None:
    seal = seal_tensors(SEALER, ENGINE_LABEL, ENGINE_INPUTS, {"LORA_OP": "list"})
    blobs = {"LORA_OP": b"list", "LORA": None, "LORA_EVICT": b""}  # as the engine reads them
    check_tensors(SEALER, seal, ENGINE_LABEL, ENGINE_INPUTS, blobs, what="the engine call")
    with pytest.raises(Forbidden):
        check_tensors(
            SEALER, seal, ENGINE_LABEL, ENGINE_INPUTS, {"LORA_OP": b"load"}, what="engine"
        )


def test_a_seal_key_must_be_long_enough() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"short")


def test_a_seal_of_any_text_is_refused_as_forbidden() -> None:
    """A caller sets the seal inputs: non-ASCII text is a refusal, never an internal error."""
    for forged in ("é" * 64, "\udcff" * 64, "0" * 63):
        with pytest.raises(Forbidden, match="does not verify"):
            SEALER.check(forged, ANSWER_LABEL, b"x", what="answer")


def test_a_seal_is_hmac_sha256_of_the_label_and_length_prefixed_parts() -> None:
    """The keyed context is copied per seal, never updated in place: every seal, however many
    came before it and in whatever order, equals the one-shot HMAC of its own message."""
    key = derive_key(b"s" * 32, "stage seal")
    parts = (b"", b"x" * 700, "é".encode())
    message = b"answer" + b"".join(struct.pack(">Q", len(p)) + p for p in parts)
    expected = hmac.digest(key, message, "sha256").hex()
    sealer = Sealer(key)
    assert [sealer.seal(ANSWER_LABEL, *parts) for _ in range(3)] == [expected] * 3
    assert sealer.seal(ENGINE_LABEL) != expected
    assert sealer.seal(ANSWER_LABEL, *parts) == expected
    assert SEALER.seal(ANSWER_LABEL, *parts) == expected
