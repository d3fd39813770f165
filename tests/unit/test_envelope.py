"""The inter-stage envelope's codec (tiercache.stages.envelope): round trips, a versioned
canonical encoding, and hostile input refused as InvalidRequest (its seal: test_seal.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tiercache.errors import Forbidden, InvalidRequest, Unavailable
from tiercache.exact.keys import Digest, key_fields
from tiercache.exact.request import GenerationRequest
from tiercache.exact.tenant_keys import KeyFile, add_key, hash_key, revoke_key
from tiercache.stages.envelope import (
    ENVELOPE_VERSION,
    ISSUE_STEP_S,
    Envelope,
    Freshness,
    ReceivedEnvelope,
    issued_now,
)
from tiercache.stages.seal import Sealer
from tiercache.vocabulary import CacheStatus

ISSUED_S = 1_790_000_000  # a fixed issue time: these envelopes are built at import
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
    serve_ttl_s=3600.0,
    key="c" * 64,
    issued_s=ISSUED_S,
)
UNKEYED = dataclasses.replace(FULL, key="")  # as a server without a key file sends it


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
        # NaN, Infinity and numbers past a double are not JSON to the decoder (so every float
        # it reads is finite)
        (_mutated(("request", "temperature"), float("nan")), "not JSON"),
        (_mutated(("request", "top_p"), float("inf")), "not JSON"),
        (
            _mutated(("max_age_s",), 1.0).replace(b'"max_age_s": 1.0', b'"max_age_s": 1e999'),
            "infinity",
        ),
        # an integer past 64 bits is read as a float: not an integer
        (_mutated(("issued_s",), 2**70), "issued_s has the wrong type"),
        (_mutated(("request", "history"), [["robot", "x"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), [[["user"], "x"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), [["user", "x", "y"]]), "role, content\\] pairs"),
        (_mutated(("request", "history"), "user: x"), "history has the wrong type"),
        (_mutated(("request", "raw_prompt"), 1), "raw_prompt has the wrong type"),
        (_mutated(("request", "drafts"), ["text"]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), [["index", "x"]]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), [["answer", 5]]), "source, text\\] pairs"),
        (_mutated(("request", "drafts"), "x"), "drafts has the wrong type"),
        (_mutated(("request", "drafts"), [["answer", "x"]] * 9), "drafts holds 9, at most 8"),
        (_mutated(("status",), "hit"), "status 'hit' is unknown"),
        (_mutated(("digest",), 7), "digest has the wrong type"),
        (_mutated(("cache_tags",), "kb"), "cache_tags has the wrong type"),
        (_mutated(("key",), None), "key has the wrong type"),
        (_mutated(("issued_s",), 1.5), "issued_s has the wrong type"),
        (_mutated(("issued_s",), _DELETE), "lacks 'issued_s'"),
    ],
)
def test_hostile_input_is_an_invalid_request(data: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        Envelope.decode(data)


def test_a_received_envelope_is_checked_and_decoded_once_and_only_when_asked() -> None:
    sealer = Sealer(b"k" * 32)
    # a hit passed on never looks at it
    received = ReceivedEnvelope(b"not sealed", sealer, Freshness())
    with pytest.raises(Forbidden, match="not sealed"):
        received.get()
    good = ReceivedEnvelope(UNKEYED.seal(sealer), sealer, Freshness(clock=lambda: ISSUED_S))
    assert good.get() is good.get() and good.get() == UNKEYED
    assert good.seal == UNKEYED.seal(sealer)[:64].decode()
    with pytest.raises(InvalidRequest, match="ENVELOPE is required"):
        ReceivedEnvelope(None, sealer, Freshness()).get()


def test_an_oversized_envelope_is_refused_before_its_seal_is_computed() -> None:
    """Every stage's seal check (check_sealed: embedding_cache, lora_cache, llm, torch_llm)
    refuses an ENVELOPE over MAX_ENVELOPE_BYTES before the HMAC reads it."""
    from tiercache.stages.envelope import MAX_ENVELOPE_BYTES

    class Counting(Sealer):
        checked = 0

        def check(self, *args: object, **kwargs: object) -> None:
            Counting.checked += 1
            super().check(*args, **kwargs)  # type: ignore[arg-type]

    sealer = Counting(b"k" * 32)
    huge = b"0" * 64 + b"{" + b" " * MAX_ENVELOPE_BYTES + b"}"
    with pytest.raises(InvalidRequest, match="over"):
        ReceivedEnvelope(huge, sealer, Freshness()).get()
    with pytest.raises(InvalidRequest, match="over"):
        Envelope.open(huge, sealer, Freshness(), "a cached answer")
    assert Counting.checked == 0


# -- freshness: a sealed envelope is acted on while it is recent and its key still allows it ----


def test_an_envelope_is_issued_now_in_steps() -> None:
    assert issued_now(lambda: 1_790_000_039.9) == 1_789_999_980  # whole minutes since 1970
    assert issued_now(lambda: 1_790_000_040.0) == 1_790_000_040
    before = issued_now()
    made = Envelope(request=GenerationRequest(prompt="hi"))
    assert made.issued_s % ISSUE_STEP_S == 0 and before <= made.issued_s <= issued_now()
    # two envelopes made in one step are equal: prompt_cache's memo of sealed hits holds
    assert Envelope(request=GenerationRequest(prompt="hi"), issued_s=made.issued_s) == made


@pytest.mark.parametrize(
    ("age_s", "fragment"),
    [
        (0.0, None),
        (300.0 + ISSUE_STEP_S, None),  # the step's rounding is allowed for
        (300.0 + ISSUE_STEP_S + 1, f"issued {301 + ISSUE_STEP_S} s ago, over the 300 s"),
        (-60.0, None),
        (-61.0, "61 s ahead of this host's clock"),
    ],
)
def test_an_envelope_older_than_its_age_is_refused(age_s: float, fragment: str | None) -> None:
    fresh = Freshness(300.0, clock=lambda: ISSUED_S + age_s)
    if fragment is None:
        fresh.check(UNKEYED)
    else:
        with pytest.raises(Forbidden, match=fragment):
            fresh.check(UNKEYED)


def test_a_kept_envelope_is_checked_again_for_each_request() -> None:
    """A stage may keep a received envelope (llm's memo of decoded hits): its seal is checked
    once, its freshness again by `fresh` (once per request)."""
    now = [float(ISSUED_S)]
    sealer = Sealer(b"k" * 32)
    kept = ReceivedEnvelope(UNKEYED.seal(sealer), sealer, Freshness(60.0, clock=lambda: now[0]))
    assert kept.fresh() == UNKEYED and kept.get() == UNKEYED
    now[0] += 60 + ISSUE_STEP_S + 1
    with pytest.raises(Forbidden, match="over the 60 s"):
        kept.fresh()
    stale = ReceivedEnvelope(UNKEYED.seal(sealer), sealer, Freshness(60.0, clock=lambda: now[0]))
    with pytest.raises(Forbidden, match="over the 60 s"):
        stale.get()  # checked when first read


def _keyed(tmp_path: Path, adapters: list[str] | None = None) -> tuple[Path, str, Envelope]:
    path = tmp_path / "api_keys.json"
    key, grant = add_key(path, "acme", adapters=adapters)
    assert grant.key_hash == hash_key(key)
    request = GenerationRequest(prompt="hi", lora_name="brief")
    return path, grant.key_id, Envelope(request=request, key=grant.key_hash)


def test_a_revoked_keys_envelope_is_refused(tmp_path: Path) -> None:
    now = [1_000.0]  # the key file's reload check (at most once a second) follows this clock
    path, key_id, envelope = _keyed(tmp_path)
    fresh = Freshness(keys=KeyFile(path, clock=lambda: now[0]))
    fresh.check(envelope)
    assert revoke_key(path, key_id)
    now[0] += 2
    with pytest.raises(Forbidden, match="has been revoked"):
        fresh.check(envelope)
    with pytest.raises(Forbidden, match="names no API key, and this server requires one"):
        fresh.check(Envelope(request=envelope.request))
    Freshness().check(Envelope(request=envelope.request))  # no key file: no key asked for
    # a stage without the key file prompt_cache read cannot check the key: it refuses
    with pytest.raises(Unavailable, match="without the API key file prompt_cache reads"):
        Freshness().check(envelope)


def test_an_envelope_for_an_adapter_its_key_no_longer_allows_is_refused(tmp_path: Path) -> None:
    path, _, envelope = _keyed(tmp_path, adapters=["caps"])  # brief is not among them
    with pytest.raises(Forbidden, match="may no longer use 'brief'"):
        Freshness(keys=KeyFile(path)).check(envelope)
    base = Envelope(request=GenerationRequest(prompt="hi"), key=envelope.key)
    Freshness(keys=KeyFile(path)).check(base)  # the base model is every key's


def test_the_decoders_field_tables_follow_the_dataclasses_order() -> None:
    """`Envelope.decode` builds the request and the envelope from its field tables by position:
    each table names the dataclass's fields in their order (the round trips above cannot see
    two swapped fields of one type and value)."""
    from tiercache.stages import envelope as codec

    request_names = [name for name, _, _ in codec._REQUEST_FIELDS]
    assert request_names == [f.name for f in dataclasses.fields(GenerationRequest)]
    assert (request_names[codec._HISTORY], request_names[codec._DRAFTS]) == ("history", "drafts")
    envelope_names = ["request", *(name for name, _, _ in codec._ENVELOPE_FIELDS)]
    assert envelope_names == [f.name for f in dataclasses.fields(Envelope)]
