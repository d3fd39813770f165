"""tiercache.gateway.openai_api: OpenAI request bodies checked before anything reaches Triton,
and the response objects the gateway builds."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tiercache.errors import InvalidRequest
from tiercache.gateway import openai_api as api

BASE = "tiercache"
ADAPTERS = frozenset({"caps"})
USER = {"role": "user", "content": "Hi"}


def parse(body: Any, chat: bool = True, header: str | None = None) -> api.Generation:
    return api.parse_request(
        body, chat=chat, base_model=BASE, adapters=ADAPTERS, cache_header=header
    )


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], **fields}


@pytest.mark.parametrize(
    "body",
    [
        {"guided_json": {"type": "object"}},  # vLLM's constrained decoding: answered unconstrained
        {"ignore_eos": True},
        {"min_tokens": 20},
        {"reasoning_effort": "high"},
        {"tiercache": {"cache-control": "no-store"}},  # a misspelt tiercache field
        {"prompt": "Hi"},  # /v1/completions' field on the chat route
    ],
)
def test_a_field_the_server_does_not_know_is_a_400_naming_it(body: dict[str, object]) -> None:
    """Ignored, such a request was answered (and cached, then served to the next caller) as
    if it had not asked for anything; OpenAI's own server refuses it likewise."""
    name = next(iter(body["tiercache"])) if "tiercache" in body else next(iter(body))
    with pytest.raises(InvalidRequest, match=f"unrecognized .*{re.escape(repr(name))}"):
        parse(chat(**body))


def test_a_chat_request_becomes_one_generation() -> None:
    gen = parse(chat(max_completion_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop="\n"))
    assert (gen.prompt, gen.model, gen.lora_name, gen.stream) == ("Hi", BASE, None, False)
    assert (gen.max_tokens, gen.temperature, gen.top_p, gen.seed) == (5, 0.5, 0.9, 3)
    assert gen.stop_words == ("\n",) and gen.chat
    assert parse(chat(max_tokens=7)).max_tokens == 7
    assert parse(chat(max_completion_tokens=5, max_tokens=7)).max_tokens == 5  # the newer name
    with pytest.raises(InvalidRequest, match="max_tokens"):  # checked beside it all the same
        parse(chat(max_completion_tokens=5, max_tokens="abc"))
    on_caps = parse({"model": "caps", "prompt": "Hi", "stream": True}, chat=False)
    assert (on_caps.lora_name, on_caps.stream, on_caps.chat) == ("caps", True, False)
    assert parse(chat(store=False, metadata={"app": "x"}, user="u-1")).user == "u-1"
    assert parse(chat(safety_identifier="s", prompt_cache_key="k")).prompt == "Hi"
    assert parse(chat(top_k=5, min_p=0, repetition_penalty=1)).top_k == 5  # neutral: accepted
    assert parse(chat()).top_k is None
    # OpenAI's seed is a signed 64-bit integer: a negative one in two's complement, distinct
    assert [parse(chat(seed=s)).seed for s in (-1, -(2**63), 2**63 - 1)] == [
        2**64 - 1,
        2**63,
        2**63 - 1,
    ]
    with pytest.raises(InvalidRequest, match="'seed' must be in"):
        parse(chat(seed=2**63))
    # null is the default, as for every other field
    assert not parse(chat(stream=True, stream_options={"include_usage": None})).include_usage


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ([], "JSON object"),
        ({"messages": []}, "'model' is required"),
        (chat(n=2), "'n' must be 1"),
        (chat(messages=[]), "non-empty list"),
        (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "must be a string"),
        (
            chat(
                messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
            ),
            "last message must be the user's",
        ),
        (chat(messages=[{"role": "tool", "content": "x"}]), "'tool' is not supported"),
        (
            chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "only text parts",
        ),
        (
            chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{}]}, USER]),
            "tools are not supported",
        ),
        (chat(temperature="hot"), "'temperature' must be a number"),
        (chat(temperature=3), "'temperature' must be in"),
        (chat(max_tokens=0), "'max_tokens' must be in"),
        (chat(max_tokens=True), "'max_tokens' must be an integer"),
        (chat(stop=["a", "b", "c", "d", "e"]), "at most 4"),
        (chat(stop=[1]), "'stop' must be"),
        (chat(stream="yes"), "'stream' must be a boolean"),
        (chat(tiercache=[]), "'tiercache' must be an object"),
        (chat(stream_options=True), "'stream_options' must be an object"),
        (
            chat(stream=True, stream_options={"include_usage": 1}),
            "include_usage' must be a boolean",
        ),
        (chat(stream_options={"include_usage": True}), "only allowed when 'stream' is true"),
        (
            chat(
                messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}, USER]
            ),
            "carries tool_calls",
        ),
        (
            chat(messages=[{"role": "assistant", "content": "x", "function_call": {"n": 1}}, USER]),
            "carries function_call",
        ),
        (chat(messages=[{"role": "user", "content": "x", "tool_call_id": "1"}]), "tool_call_id"),
        (chat(top_k=-1), "'top_k' must be in"),
        (chat(top_k=True), "'top_k' must be an integer"),
        (chat(min_p=0.1), "'min_p' is not supported"),
        (chat(repetition_penalty=1.2), "'repetition_penalty' is not supported"),
        (chat(tiercache={"cache_control": 1}), "must be a string"),
    ],
)
def test_bad_requests_name_the_field(body: Any, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        parse(body)


def test_a_conversation_becomes_history_and_its_last_user_turn() -> None:
    gen = parse(
        chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello!", "name": "bot"},
                {"role": "user", "content": [{"type": "text", "text": t} for t in "ab"]},
            ]
        )
    )
    assert gen.history == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    )
    assert gen.prompt == "a\nb"
    assert parse(chat()).history == ()


def test_null_is_the_default_of_optional_fields() -> None:
    gen = parse(chat(n=None, stream=None, max_tokens=None, temperature=None, stop=None))
    assert (gen.stream, gen.max_tokens, gen.temperature, gen.stop_words) == (False, None, None, ())


def test_finish_reasons_are_openai_s() -> None:
    for engine, shown in (("length", "length"), ("content_filter", "content_filter")):
        assert api.finish_reason(api.Outcome(finish_reason=engine)) == shown
    for other in (None, "cancelled", "error"):
        assert api.finish_reason(api.Outcome(finish_reason=other)) == "stop"


def test_usage_is_openai_s_object_and_absent_without_counts() -> None:
    outcome = api.Outcome(
        text="x", prompt_tokens=30, completion_tokens=5, cached_tokens=16, speculated_tokens=3
    )
    assert api.usage(outcome) == {
        "prompt_tokens": 30,
        "completion_tokens": 5,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 16},
        "completion_tokens_details": {"accepted_prediction_tokens": 3},
    }
    assert api.usage(api.Outcome(text="x")) is None  # a padded tenant's answer
    gen = parse(chat(stream=True, stream_options={"include_usage": True}))
    last = api.usage_chunk(gen, outcome)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 35
    assert api.chunk(gen, "a")["usage"] is None
    assert "usage" not in api.chunk(parse(chat(stream=True)), "a")


def test_an_unknown_model_is_its_own_error() -> None:
    with pytest.raises(api.UnknownModel, match="does not exist"):
        parse(chat(model="gpt-4"))
    with pytest.raises(InvalidRequest, match="lists of prompts"):
        parse({"model": BASE, "prompt": ["a", "b"]}, chat=False)


def test_cache_control_comes_from_the_header_and_the_body() -> None:
    assert api.cache_control_words(None, None) is None
    assert api.cache_control_words("No-Cache, private, max-age=60", None) == "no-cache, max-age=60"
    assert api.cache_control_words("max-age=abc", "tag=docs") == "tag=docs"
    assert api.cache_control_words('max-age="0", no-store', None) == "max-age=0, no-store"
    assert api.cache_control_words('max-age="', None) is None
    gen = parse(chat(tiercache={"cache_control": "no-semantic"}), header="no-store")
    assert gen.cache_control == "no-store, no-semantic"


def test_responses_follow_openai_s_objects() -> None:
    gen = parse(chat())
    hit = api.Outcome("Hello", "semantic", 0.93, None)
    body = api.completion(gen, hit)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["choices"][0]["finish_reason"] == "stop"  # a cached answer was complete
    assert body["tiercache"] == {"cache_status": "semantic", "similarity": 0.93}
    first = api.first_chunk(gen)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = api.chunk(gen, "", final=api.Outcome("Hi", "miss", None, "length"))
    assert last["choices"][0]["finish_reason"] == "length" and last["tiercache"] == {
        "cache_status": "miss"
    }
    text = api.completion(parse({"model": BASE, "prompt": "x"}, chat=False), hit)
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Hello"
    assert (
        api.error_body("bad", "invalid_request_error")["error"]["type"] == "invalid_request_error"
    )


def test_text_that_cannot_travel_as_utf8_is_a_bad_request() -> None:
    with pytest.raises(InvalidRequest, match="not valid Unicode"):
        parse(chat(messages=[{"role": "user", "content": "a\ud800b"}]))
    with pytest.raises(InvalidRequest, match="stop"):
        parse(chat(stop=["\udfff"]))


def test_refusals_map_to_openai_status_codes() -> None:
    from tiercache.gateway.app import error_response
    from tiercache_client.errors import ForbiddenError, UnavailableError

    def status(exc: BaseException) -> int:
        return error_response(exc).status_code

    assert status(ForbiddenError("unknown API key")) == 401
    assert status(ForbiddenError("an API key is required (send it ...)")) == 401
    assert status(ForbiddenError("this API key may not use adapter 'caps'")) == 403
    assert status(ForbiddenError("the tenant input does not match the API key's tenant")) == 403
    assert status(UnavailableError("connection refused")) == 503
    assert status(api.UnknownModel("gpt-4")) == 404
    assert status(RuntimeError("a bug")) == 500


def test_a_gateway_without_triton_answers_503_and_bounds_bodies() -> None:
    """No Triton behind it (a closed port): a request is a 503, not a 500; an oversized body is
    a 413 and a JSON number past Python's int limit a 400, before anything else."""
    import httpx2

    from tiercache.gateway.app import MAX_BODY_BYTES, GatewaySettings, running_in_thread
    from tiercache.server import free_port

    settings = GatewaySettings(triton_url=f"127.0.0.1:{free_port()}", timeout_s=10)
    with running_in_thread(settings, free_port()) as url:
        body = {"model": BASE, "prompt": "Hi", "max_tokens": 4}
        down = httpx2.post(f"{url}/v1/completions", json=body, timeout=60)
        assert down.status_code == 503 and down.json()["error"]["type"] == "server_error"
        assert httpx2.get(f"{url}/health", timeout=60).status_code == 503
        as_json = {"content-type": "application/json"}
        big = httpx2.post(
            f"{url}/v1/completions",
            content=b"x" * (MAX_BODY_BYTES + 1),
            headers=as_json,
            timeout=60,
        )
        assert big.status_code == 413
        huge = httpx2.post(
            f"{url}/v1/completions", content=b'{"n": ' + b"9" * 5000 + b"}", headers=as_json
        )
        assert huge.status_code == 400
        # a body not sent as JSON (what a web page can post across sites without a preflight)
        plain = httpx2.post(f"{url}/v1/completions", content=b"{}", timeout=60)
        assert plain.status_code == 415
        assert plain.json()["error"]["code"] == "unsupported_media_type"
