"""The inter-stage envelope's codec (tiercache.stages.envelope): round trips, a versioned
canonical encoding, and hostile input refused as InvalidRequest (its seal: test_seal.py)."""

from __future__ import annotations

import json

import pytest

from tiercache.errors import Forbidden, InvalidRequest
from tiercache.exact.keys import Digest, key_fields
from tiercache.exact.request import GenerationRequest
from tiercache.stages.envelope import ENVELOPE_VERSION, Envelope, ReceivedEnvelope
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import CacheStatus

FULL = Envelope(
    request=GenerationRequest(
        prompt='héllo \u2603 "quoted"',
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=2**64 - 1,
        stop_words=("\n", "END"),
        stream=True,
        lora_name="adapter-a",
        lora_task_id=3,
        lora_digest="d" * 64,
        tenant_scope="f" * 64,
        history=(("system", "Be brief."), ("user", "Hi"), ("assistant", "")),
        speculate=False,
        drafts=(
            ("answer", "a cached answer"),
            ("neighbour", "a neighbour's answer"),
            ("verify", "a semantic hit's answer"),
        ),
        index_answer=False,
    ),
    status=CacheStatus.MISS,
    digest=Digest("a" * 64),
    write_back=True,
    semantic_scope="s" * 64,
    semantic_lookup=True,
    cache_tags=("a", "kb:v1"),
    max_age_s=2.5,
    draft_digest="f" * 64,
    verify_semantic=True,
)


@pytest.mark.parametrize(
    "envelope",
    [
        Envelope(request=GenerationRequest(prompt="hi")),
        FULL,
        Envelope(request=GenerationRequest(prompt="hi"), max_age_s=0.0),
        Envelope(request=GenerationRequest(prompt="hi"), status=CacheStatus.EXACT),
        Envelope(request=GenerationRequest(prompt="<|im_start|>user\nhi\n", raw_prompt=True)),
    ],
)
def test_round_trip(envelope: Envelope) -> None:
    assert Envelope.decode(envelope.encode()) == envelope
    assert Envelope.decode(envelope.encode().decode("utf-8")) == envelope  # text works too


def test_encoding_is_canonical_and_versioned() -> None:
    data = FULL.encode()
    document = json.loads(data)
    assert document["v"] == ENVELOPE_VERSION
    assert (
        data
        == json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    )
    assert data == FULL.encode()  # the same envelope always encodes to the same bytes


def test_the_key_is_not_the_envelope() -> None:
    """Directives and lookup results travel in the envelope, never into the key's canonical
    form: the same request with other directives has the same key fields."""
    other = Envelope(request=FULL.request, cache_tags=(), max_age_s=None, write_back=False)
    assert key_fields(other.request) == key_fields(FULL.request)
    assert other.encode() != FULL.encode()


def _mutated(path: tuple[str, ...], value: object) -> bytes:
    document = json.loads(FULL.encode())
    target = document
    for name in path[:-1]:
        target = target[name]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return json.dumps(document).encode()


_DELETE = object()


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "ENVELOPE is required"),
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (_mutated(("v",), 99), "version 99 is not supported"),
        (_mutated(("v",), _DELETE), "lacks 'v'"),
        (_mutated(("request",), "text"), "ENVELOPE.request has the wrong type"),
        (_mutated(("request", "prompt"), _DELETE), "lacks 'prompt'"),
        (_mutated(("request", "prompt"), 5), "request.prompt has the wrong type"),
        (_mutated(("request", "max_tokens"), "7"), "max_tokens has the wrong type"),
        (_mutated(("request", "max_tokens"), True), "max_tokens has the wrong type"),
        (_mutated(("request", "stream"), 1), "stream has the wrong type"),
        (_mutated(("request", "stop_words"), ["a", 1]), "list of strings"),
        (_mutated(("request", "temperature"), float("nan")), "must be finite"),
        (_mutated(("request", "history"), [["robot", "x"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), [[["user"], "x"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), [["user", "x", "y"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), "user: x"), "history has the wrong type"),
        (_mutated(("request", "raw_prompt"), 1), "raw_prompt has the wrong type"),
        (_mutated(("request", "drafts"), ["text"]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), [["index", "x"]]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), [["answer", 5]]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), "x"), "drafts has the wrong type"),
        (_mutated(("status",), "hit"), "status 'hit' is unknown"),
        (_mutated(("digest",), 7), "digest has the wrong type"),
        (_mutated(("cache_tags",), "kb"), "cache_tags has the wrong type"),
    ],
)
def test_hostile_input_is_an_invalid_request(data: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        Envelope.decode(data)


def test_a_received_envelope_is_checked_and_decoded_once_and_only_when_asked() -> None:
    sealer = Sealer(b"k" * 32)
    received = ReceivedEnvelope(b"not sealed", sealer)  # a hit passed on never looks at it
    with pytest.raises(Forbidden, match="not sealed"):
        received.get()
    good = ReceivedEnvelope(FULL.seal(sealer), sealer)
    assert good.get() is good.get() and good.get() == FULL
    assert good.seal == FULL.seal(sealer)[:64].decode()
    with pytest.raises(InvalidRequest, match="ENVELOPE is required"):
        ReceivedEnvelope(None, sealer).get()
