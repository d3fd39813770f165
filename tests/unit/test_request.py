"""Canonicalization and validation of generation requests (tiercache.exact.request)."""

from __future__ import annotations

import math
import re
import unicodedata

import numpy as np
import pytest

from tiercache.errors import InvalidRequest
from tiercache.exact.keys import key_fields
from tiercache.exact.request import (
    CacheControl,
    GenerationRequest,
    Limits,
    RawInputs,
    canonicalize,
)


def canon(text: str | None = "What is Triton?", **kwargs: object) -> GenerationRequest:
    return canonicalize(RawInputs(text_input=text, **kwargs)).request  # type: ignore[arg-type]


def _canon_params(params: dict[str, object]) -> GenerationRequest:
    kwargs = dict(params)
    return canon(kwargs.pop("text", "What is Triton?"), **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- equal after canonicalization

SAME = [
    pytest.param({"text": "  What is Triton?"}, {}, id="leading-spaces"),
    pytest.param({"text": "What is Triton?   "}, {}, id="trailing-spaces"),
    pytest.param({"text": "What   is  Triton?"}, {}, id="multiple-spaces"),
    pytest.param({"text": "What\tis\tTriton?"}, {}, id="tabs"),
    pytest.param({"text": "What\nis\r\nTriton?\n"}, {}, id="newlines"),
    pytest.param({"text": "What\u00a0is\u3000Triton?"}, {}, id="unicode-spaces"),
    pytest.param({"text": "Ｗｈａｔ is Triton?"}, {}, id="nfkc-fullwidth"),
    pytest.param({"text": "a \ufb01le"}, {"text": "a file"}, id="nfkc-ligature"),
    pytest.param({"max_tokens": 128}, {}, id="explicit-max-tokens"),
    pytest.param({"temperature": 0.0}, {}, id="explicit-temperature"),
    pytest.param({"top_p": 1.0}, {}, id="explicit-top-p"),
    pytest.param({"top_k": 0}, {}, id="explicit-top-k"),
    pytest.param(
        {"max_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop_words": []},
        {},
        id="all-explicit-defaults",
    ),
    pytest.param(
        {"temperature": np.float32(0.7), "seed": 1},
        {"temperature": 0.7, "seed": 1},
        id="float32-temperature",
    ),
    pytest.param(
        {"temperature": 0.7, "top_p": np.float32(0.9), "seed": 1},
        {"temperature": 0.7, "top_p": 0.9, "seed": 1},
        id="float32-top-p",
    ),
    pytest.param({"stop_words": ["b", "a"]}, {"stop_words": ["a", "b"]}, id="stop-order"),
    pytest.param({"stop_words": ["a", "b", "a"]}, {"stop_words": ["b", "a"]}, id="stop-dupes"),
    pytest.param({"stop_words": ["ＥＮＤ"]}, {"stop_words": ["END"]}, id="stop-nfkc"),
    pytest.param({"stop_words": ["", "x"]}, {"stop_words": ["x"]}, id="stop-empty-dropped"),
    pytest.param({"temperature": 0.0, "top_p": 0.5}, {}, id="greedy-drops-top-p"),
    pytest.param({"temperature": 0.0, "top_k": 5}, {}, id="greedy-drops-top-k"),
    pytest.param({"temperature": 0.0, "seed": 9}, {}, id="greedy-drops-seed"),
    pytest.param({"top_p": 0.5, "top_k": 5, "seed": 9}, {}, id="greedy-drops-all"),
    pytest.param({"lora_name": "  "}, {}, id="blank-lora"),
    pytest.param({"stream": True}, {"stream": False}, id="stream-not-in-key"),
    pytest.param({"history": "[]"}, {}, id="empty-history"),
    pytest.param({"history": "  "}, {}, id="blank-history"),
    pytest.param({"raw_prompt": False}, {}, id="explicit-templated"),
    pytest.param(
        {"history": '[{"role": "user", "content": "  Hi\\n there "}]'},
        {"history": '[{"content": "Hi there", "role": "user"}]'},
        id="history-normalized-like-a-prompt",
    ),
]


@pytest.mark.parametrize(("a", "b"), SAME)
def test_canonicalizes_equal(a: dict[str, object], b: dict[str, object]) -> None:
    ra, rb = _canon_params(a), _canon_params(b)
    assert key_fields(ra) == key_fields(rb)
    if ra.stream == rb.stream:
        assert ra == rb


DIFFERENT = [
    pytest.param({"max_tokens": 10}, {"max_tokens": 11}, id="max-tokens"),
    pytest.param(
        {"temperature": 0.7, "seed": 1}, {"temperature": 0.7, "seed": 2}, id="seed-sampled"
    ),
    pytest.param({"temperature": 0.7}, {"temperature": 0.8}, id="temperature"),
    pytest.param({"temperature": 0.7}, {}, id="sampled-vs-greedy"),
    pytest.param({"temperature": 0.7, "top_p": 0.5}, {"temperature": 0.7}, id="top-p-sampled"),
    pytest.param({"temperature": 0.7, "top_k": 5}, {"temperature": 0.7}, id="top-k-sampled"),
    pytest.param({"stop_words": ["a"]}, {"stop_words": ["b"]}, id="stop-words"),
    pytest.param({"stop_words": ["\n"]}, {}, id="whitespace-stop-word-kept"),
    pytest.param({"lora_name": "x"}, {}, id="lora-name"),
    pytest.param({"text": "What is Triton"}, {}, id="prompt"),
    pytest.param({"text": "what is triton?"}, {}, id="prompt-case"),
    pytest.param({"history": '[{"role": "user", "content": "Hi"}]'}, {}, id="history"),
    pytest.param(
        {"history": '[{"role": "user", "content": "Hi"}]'},
        {"history": '[{"role": "system", "content": "Hi"}]'},
        id="history-role",
    ),
    pytest.param({"raw_prompt": True}, {}, id="raw-prompt"),
    pytest.param(
        {"text": "a\nb", "raw_prompt": True},
        {"text": "a b", "raw_prompt": True},
        id="raw-prompt-keeps-spacing",
    ),
]


@pytest.mark.parametrize(("a", "b"), DIFFERENT)
def test_canonicalizes_different(a: dict[str, object], b: dict[str, object]) -> None:
    ra, rb = _canon_params(a), _canon_params(b)
    assert key_fields(ra) != key_fields(rb)


def test_no_speculate_turns_speculation_off_for_the_request_not_its_key() -> None:
    off = canon("Hi", cache_control="no-speculate")
    assert canon("Hi").speculate and not off.speculate
    assert key_fields(off) == key_fields(canon("Hi"))


def test_verify_semantic_is_a_directive_not_part_of_the_key() -> None:
    from tiercache.exact.request import CacheControl

    assert CacheControl.parse("no-store, verify-semantic").verify_semantic
    assert not CacheControl.parse("no-store").verify_semantic
    assert key_fields(canon("Hi", cache_control="verify-semantic")) == key_fields(canon("Hi"))


def test_a_conversation_is_canonical_turns() -> None:
    history = '[{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": ""}]'
    r = canon("Hi", history=history)
    assert r.history == (("system", "Be brief."), ("assistant", "")) and not r.raw_prompt
    assert key_fields(r)["history"] == [["system", "Be brief."], ["assistant", ""]]
    raw = canon("<|im_start|>user\n Hi\n", raw_prompt=True)
    assert raw.prompt == "<|im_start|>user\n Hi\n" and key_fields(raw)["raw_prompt"] is True


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"history": "not json"}, "history is not JSON"),
        ({"history": '{"role": "user"}'}, "JSON list"),
        ({"history": '["user: hi"]'}, 'exactly "role" and "content"'),
        ({"history": '[{"role": "user", "content": "x", "name": "a"}]'}, "exactly"),
        ({"history": '[{"role": "tool", "content": "x"}]'}, "history\\[0\\].role must be one of"),
        ({"history": '[{"role": ["user"], "content": "x"}]'}, "role must be one of"),
        ({"history": '[{"role": "user", "content": 5}]'}, "content must be a string"),
        ({"history": '[{"role": "user", "content": "\\ud800"}]'}, "lone surrogate"),
        ({"history": "[]", "raw_prompt": True, "text": "x"}, ""),
        (
            {"history": '[{"role": "user", "content": "x"}]', "raw_prompt": True},
            "cannot be combined with raw_prompt",
        ),
        ({"text": " \n ", "raw_prompt": True}, "text_input is empty"),
        ({"history": "[" * 50_000 + "]" * 50_000}, "nested too deeply"),
        ({"top_p": 1e-300, "temperature": 0.5}, "top_p must be in \\(0, 1\\], got 0"),
    ],
)
def test_a_bad_conversation_is_refused_by_name(fields: dict[str, object], fragment: str) -> None:
    if not fragment:  # an empty history with a raw prompt is no conversation: accepted
        assert canon(**fields).raw_prompt  # type: ignore[arg-type]
        return
    with pytest.raises(InvalidRequest, match=fragment):
        _canon_params(fields)


def test_history_is_bounded_in_turns_and_characters() -> None:
    limits = Limits(max_history_turns=2, max_history_chars=10)
    turn = '{"role": "user", "content": "abcd"}'
    ok = canonicalize(RawInputs("x", history=f"[{turn}, {turn}]"), limits).request
    assert len(ok.history) == 2
    with pytest.raises(InvalidRequest, match="3 turns, over the limit of 2"):
        canonicalize(RawInputs("x", history=f"[{turn}, {turn}, {turn}]"), limits)
    long = '{"role": "user", "content": "abcdefghijk"}'
    with pytest.raises(InvalidRequest, match="11 characters, over the limit of 10"):
        canonicalize(RawInputs("x", history=f"[{long}]"), limits)
    with pytest.raises(InvalidRequest, match="history has .* bytes, over the limit"):
        canonicalize(RawInputs("x", history="[" + " " * limits.max_history_bytes + "]"), limits)


def test_greedy_canonical_values() -> None:
    r = canon("hi", temperature=0.0, top_p=0.5, top_k=5, seed=9)
    assert (r.top_p, r.top_k, r.seed, r.greedy, r.deterministic) == (1.0, 0, None, True, True)


def test_sampled_keeps_parameters() -> None:
    r = canon("hi", temperature=0.7, top_p=0.5, top_k=5, seed=9)
    assert (r.temperature, r.top_p, r.top_k, r.seed, r.greedy) == (0.7, 0.5, 5, 9, False)


# ---------------------------------------------------------------- validation

INVALID = [
    pytest.param(None, {}, "text_input", id="missing-text"),
    pytest.param("", {}, "text_input", id="empty-text"),
    pytest.param(" \t\n ", {}, "text_input", id="whitespace-text"),
    pytest.param("x" * 17, {}, "text_input", id="prompt-over-limit"),
    pytest.param("hi", {"max_tokens": 0}, "max_tokens", id="max-tokens-0"),
    pytest.param("hi", {"max_tokens": -1}, "max_tokens", id="max-tokens-negative"),
    pytest.param("hi", {"max_tokens": 257}, "max_tokens", id="max-tokens-over"),
    pytest.param("hi", {"temperature": math.nan}, "temperature", id="temperature-nan"),
    pytest.param("hi", {"temperature": math.inf}, "temperature", id="temperature-inf"),
    pytest.param("hi", {"temperature": -0.1}, "temperature", id="temperature-negative"),
    pytest.param("hi", {"temperature": 2.01}, "temperature", id="temperature-over-2"),
    pytest.param("hi", {"top_p": 0.0}, "top_p", id="top-p-0"),
    pytest.param("hi", {"top_p": 1.01}, "top_p", id="top-p-over-1"),
    pytest.param("hi", {"top_p": math.nan}, "top_p", id="top-p-nan"),
    pytest.param("hi", {"top_k": -1}, "top_k", id="top-k-negative"),
    pytest.param("hi", {"top_k": 2**32 + 1, "temperature": 0.5}, "top_k", id="top-k-past-int32"),
    pytest.param("hi", {"seed": -1, "temperature": 0.5}, "seed", id="seed-negative"),
    pytest.param("hi", {"seed": 2**64}, "seed", id="seed-over-uint64"),
    pytest.param("hi", {"stop_words": [str(i) for i in range(5)]}, "stop_words", id="stops"),
    pytest.param("hi", {"stop_words": ["x" * 9]}, "stop word", id="stop-word-too-long"),
    pytest.param("hi", {"tenant": "t" * 9}, "tenant", id="tenant-too-long"),
    pytest.param("hi", {"cache_control": "no-cache, bogus"}, "cache_control", id="cache-word"),
]

SMALL = Limits(
    max_prompt_chars=16, max_tokens=256, max_stop_words=4, max_stop_word_chars=8, max_tenant_chars=8
)


@pytest.mark.parametrize(("text", "kwargs", "field"), INVALID)
def test_invalid_request_names_field(
    text: str | None, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        canonicalize(RawInputs(text_input=text, **kwargs), SMALL)  # type: ignore[arg-type]
    assert field in info.value.message
    assert info.value.client_message().startswith("invalid request: ")


def test_limits_are_inclusive() -> None:
    canonicalize(
        RawInputs(
            "x" * 16,
            max_tokens=256,
            temperature=2.0,
            top_p=1.0,
            stop_words=list("abcd"),
            tenant="t" * 8,
        ),
        SMALL,
    )


def test_prompt_limit_counts_normalized_text() -> None:
    assert canonicalize(RawInputs("  " + "x" * 16 + "  "), SMALL).request.prompt == "x" * 16


def test_unknown_cache_word_is_named() -> None:
    with pytest.raises(InvalidRequest, match="'bogus'"):
        CacheControl.parse("no-cache bogus")


# ---------------------------------------------------------------- cache_control


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (None, CacheControl()),
        ("", CacheControl()),
        ("no-cache", CacheControl(no_cache=True)),
        ("no-cache,no-store", CacheControl(no_cache=True, no_store=True)),
        ("no-cache no-store", CacheControl(no_cache=True, no_store=True)),
        (" No-Store , ALLOW-SAMPLED ", CacheControl(no_store=True, allow_sampled=True)),
        ("no-store,,no-store", CacheControl(no_store=True)),
        ("no-cache,\tno-store allow-sampled", CacheControl(True, True, True)),
    ],
)
def test_cache_control_parse(text: str | None, expected: CacheControl) -> None:
    assert CacheControl.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max-age=30", CacheControl(max_age_s=30.0)),
        ("MAX-AGE=0.5, no-store", CacheControl(no_store=True, max_age_s=0.5)),
        ("max-age=0", CacheControl(max_age_s=0.0)),
        ("max-age=5 max-age=5", CacheControl(max_age_s=5.0)),
        ("tag=kb:v7", CacheControl(tags=("kb:v7",))),
        ("tag=b TAG=A tag=b, no-cache", CacheControl(no_cache=True, tags=("A", "b"))),
        ("tag=team/a@x+y=z_1.0-rc", CacheControl(tags=("team/a@x+y=z_1.0-rc",))),
        (
            "no-semantic max-age=60 tag=kb",
            CacheControl(no_semantic=True, max_age_s=60.0, tags=("kb",)),
        ),
    ],
)
def test_cache_control_valued_words(text: str, expected: CacheControl) -> None:
    assert CacheControl.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-age=-1", "max-age must be a finite number of seconds >= 0, got '-1'"),
        ("max-age=soon", "max-age must be a finite number"),
        ("max-age=nan", "max-age must be a finite number"),
        ("max-age=inf", "max-age must be a finite number"),
        ("max-age=", "max-age must be a finite number"),
        ("max-age=1 max-age=2", "more than one max-age"),
        ("tag=", "tag '' is not 1-128 characters"),
        ("tag=has space", "unknown cache_control word"),  # "space" is a word of its own
        ("tag=ünï", "tag 'ünï' is not"),
        ("tag=" + "x" * 129, "is not 1-128 characters"),
        (" ".join(f"tag=t{i}" for i in range(17)), "17 tags, at most 16"),
        ("semantic-only max-age=5", "cannot be combined with semantic-only"),
        ("stale=5", "unknown cache_control word(s) 'stale=5'"),
    ],
)
def test_cache_control_valued_words_are_validated(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        CacheControl.parse(text)


def test_unknown_word_message_lists_the_valued_words() -> None:
    with pytest.raises(InvalidRequest, match=re.escape("max-age=<seconds>, tag=<name>")):
        CacheControl.parse("bogus")


# ---------------------------------------------------------------- JSON round trip


def test_tenant_scope_is_not_a_key_field() -> None:
    """The tenant scope enters the cache key document itself, not the request's part."""
    assert "tenant_scope" not in key_fields(GenerationRequest(prompt="hi", tenant_scope="s"))
    assert key_fields(GenerationRequest("hi", tenant_scope="s")) == key_fields(
        GenerationRequest("hi")
    )


# ---------------------------------------------------------------- cacheable


@pytest.mark.parametrize(
    ("kwargs", "cacheable"),
    [
        ({}, True),
        ({"temperature": 0.0, "seed": 5}, True),
        ({"temperature": 0.7, "seed": 5}, True),
        ({"temperature": 0.7, "seed": 0}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "cache_control": "allow-sampled"}, True),
        ({"temperature": 0.7, "cache_control": "no-cache"}, False),
    ],
)
def test_cacheable(kwargs: dict[str, object], cacheable: bool) -> None:
    assert canonicalize(RawInputs("hi", **kwargs)).cacheable is cacheable  # type: ignore[arg-type]


def test_tenant_is_normalized_but_not_in_request() -> None:
    a = canonicalize(RawInputs("hi", tenant="  ａｃｍｅ "))
    b = canonicalize(RawInputs("hi"))
    assert a.tenant == "acme"
    assert a.request == b.request


# ---------------------------------------------------------------- sizes before decoding


@pytest.fixture
def normalized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every text `canonicalize` NFKC-normalizes, recorded."""
    import tiercache.exact.request as request_module

    seen: list[str] = []
    real = unicodedata.normalize

    class Spy:
        @staticmethod
        def normalize(form: str, text: str) -> str:
            seen.append(text)
            return real(form, text)

    monkeypatch.setattr(request_module, "unicodedata", Spy)
    return seen


OVERSIZED = [
    pytest.param(
        {"text_input": "x" * (4 * 16 + 1)}, "text_input has 65 or more bytes", id="prompt"
    ),
    pytest.param(
        {"text_input": b"\xff" * 65}, "text_input has 65 or more bytes", id="prompt-bytes"
    ),
    pytest.param({"stop_words": ["a"] * 5}, "at most 4 stop_words, got 5", id="stop-count-dupes"),
    pytest.param({"stop_words": [""] * 5}, "at most 4 stop_words, got 5", id="stop-count-empty"),
    pytest.param({"stop_words": ["é" * 17]}, "a stop word has 34 or more bytes", id="stop-bytes"),
    pytest.param({"stop_words": [b"\xff" * 33]}, "a stop word has 33", id="stop-raw-bytes"),
    pytest.param({"tenant": "é" * 129}, "tenant has 258 or more bytes", id="tenant-bytes"),
    pytest.param({"tenant": b"\xff" * 300}, "tenant has 300", id="tenant-raw-bytes"),
    pytest.param({"cache_control": "no-store " * 114}, "cache_control has 1026", id="cache-ctl"),
    pytest.param({"lora_name": "a" * 257}, "lora_name has 257", id="lora-name"),
]


@pytest.mark.parametrize(("fields", "message"), OVERSIZED)
def test_sizes_are_checked_before_decoding_or_normalizing(
    normalized: list[str], fields: dict[str, object], message: str
) -> None:
    raw = {"text_input": "hi", **fields}
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        canonicalize(RawInputs(**raw), SMALL)  # type: ignore[arg-type]
    assert set(normalized) <= {"hi"}  # only the valid prompt, normalized before the rest


def test_stop_words_are_bounded_in_bytes_per_word_and_so_in_total() -> None:
    limits = Limits(max_stop_words=4, max_stop_word_chars=2)  # 8 bytes a word, 32 in all
    canonicalize(RawInputs("hi", stop_words=["😀😀"] * 4), limits)  # 32 bytes
    with pytest.raises(InvalidRequest, match="stop word has 9 or more bytes"):
        canonicalize(RawInputs("hi", stop_words=["😀😀a"]), limits)


def test_raw_bytes_inputs_are_decoded_after_the_size_check() -> None:
    canonical = canonicalize(
        RawInputs(
            b"What is Triton?",
            stop_words=[b"END", "\n"],
            tenant=" ａｃｍｅ ".encode(),
            cache_control=b"no-store",
            lora_name=b" ",
        )
    )
    assert canonical.request == canon("What is Triton?", stop_words=["END", "\n"])
    assert canonical.tenant == "acme" and canonical.cache_control.no_store


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"text_input": b"ok \xff"}, "text_input is not valid UTF-8 (byte 3)"),
        ({"stop_words": [b"\xc3"]}, "stop_words is not valid UTF-8"),
        ({"tenant": b"\xc3("}, "tenant is not valid UTF-8"),
        ({"tenant": "a\ud800"}, "tenant is not valid Unicode (a lone surrogate at character 1)"),
        ({"text_input": "hi \udfff"}, "text_input is not valid Unicode"),
    ],
)
def test_text_that_is_not_unicode_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        canonicalize(RawInputs(**{"text_input": "hi", **fields}))  # type: ignore[arg-type]


def test_default_limits_of_tenant_cache_control_and_adapter_name() -> None:
    canonicalize(RawInputs("hi", tenant="t" * 256, cache_control="no-store " * 113))
    for fields in ({"tenant": "t" * 257}, {"cache_control": "x" * 1025}, {"lora_name": "a" * 257}):
        with pytest.raises(InvalidRequest, match="bytes, over the limit"):
            canonicalize(RawInputs("hi", **fields))  # type: ignore[arg-type]


# ---------------------------------------------------------------- echoed values are cut


@pytest.mark.parametrize(
    "cache_control",
    [
        "tag=" + "x" * 900,  # an invalid tag (over 128 characters)
        "max-age=" + "9" * 900 + "z",
        "bogus=" + "x" * 900,
    ],
)
def test_a_value_echoed_in_an_error_is_cut_to_64_characters(cache_control: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        CacheControl.parse(cache_control)
    message = info.value.message
    assert "\u2026'" in message and "x" * 65 not in message and "9" * 65 not in message
    assert len(message) < 300


def test_unknown_cache_control_words_are_listed_up_to_eight() -> None:
    with pytest.raises(InvalidRequest) as info:
        CacheControl.parse(" ".join(f"w{i:03d}" for i in range(100)))
    message = info.value.message
    assert "'w007'" in message and "'w008'" not in message and "and 92 more" in message


def test_huge_numbers_are_not_echoed_whole() -> None:
    with pytest.raises(InvalidRequest) as info:
        canonicalize(RawInputs("hi", seed=10**4000))
    assert "\u2026" in info.value.message and len(info.value.message) < 200
    with pytest.raises(InvalidRequest, match="max_tokens must be in"):
        canonicalize(RawInputs("hi", max_tokens=-(10**4000)))


def test_pinned_is_replace_of_the_scope_and_adapter_fields() -> None:
    """`GenerationRequest.pinned` builds the request field by field: it must equal
    `dataclasses.replace` of its three fields for a request whose every field differs from
    its default (a field added to the class and not to `pinned` would fail here)."""
    import dataclasses

    request = GenerationRequest(
        "What is Triton?",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop_words=("END",),
        stream=True,
        lora_name="caps",
        lora_task_id=2,
        lora_digest="0" * 64,
        tenant_scope="old",
        history=(("user", "Hi"),),
        raw_prompt=True,
        speculate=False,
        drafts=(("answer", "x"),),
        index_answer=False,
    )
    defaults = GenerationRequest("")
    for f in dataclasses.fields(GenerationRequest):
        assert getattr(request, f.name) != getattr(defaults, f.name), f.name
    pinned = request.pinned("s" * 64, 5, "1" * 64)
    assert pinned == dataclasses.replace(
        request, tenant_scope="s" * 64, lora_task_id=5, lora_digest="1" * 64
    )
