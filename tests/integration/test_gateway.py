"""`tiercache gateway` (issue 16) against the session's real tritonserver, driven by the official
`openai` package and by raw HTTP: chat and completions, streamed and not, an adapter as the
model, a cached repeat showing its status, `Cache-Control: no-cache`, bad requests, SSE framing,
and 16 concurrent identical requests making one generation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest

from tiercache.gateway.app import (
    ANSWER_ID_HEADER,
    CACHE_STATUS_HEADER,
    GatewaySettings,
    running_in_thread,
)
from tiercache.server import TritonServer, free_port
from tiercache_client import TierCacheClient, read_admin_token

from .conftest import settled_metric

pytestmark = pytest.mark.integration
MAX_TOKENS = 6
BASE = "tiercache"


def unique(text: str) -> str:
    return f"{text} ({uuid.uuid4().hex[:8]})"


@contextlib.contextmanager
def running_gateway(
    server: TritonServer, adapters: frozenset[str], edge: bool = False
) -> Iterator[str]:
    """The gateway in this process (uvicorn on a thread) in front of `server`, its base URL;
    with `edge`, its edge layer on the server's repository and state."""
    settings = GatewaySettings(
        triton_url=f"127.0.0.1:{server.ports.grpc}",
        base_model=BASE,
        adapters=adapters,
        model_repository=server.model_repository if edge else None,
        state_dir=server.state_dir if edge else None,
    )
    with running_in_thread(settings, free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(server: TritonServer) -> Iterator[str]:
    """The gateway in front of the session's server (which serves no adapters: the adapter as
    `model` is tested in test_lora.py, whose server has them)."""
    with running_gateway(server, frozenset()) as url:
        yield url


@pytest.fixture(scope="module")
def oai(gateway: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def test_health_and_models(gateway: str) -> None:
    assert httpx.get(f"{gateway}/health").json() == {"status": "ok"}
    ids = [m["id"] for m in httpx.get(f"{gateway}/v1/models").json()["data"]]
    assert ids == [BASE]


def test_a_chat_completion_then_its_cached_repeat(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": unique("What is Triton?")}]
    raw = oai.chat.completions.with_raw_response.create(
        model=BASE,
        messages=messages,
        max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
    )
    first = raw.parse()
    assert raw.headers[CACHE_STATUS_HEADER] == "miss"
    assert first.object == "chat.completion" and first.model == BASE
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.model_extra and first.model_extra["tiercache"]["cache_status"] == "miss"
    again = oai.chat.completions.with_raw_response.create(
        model=BASE,
        messages=messages,
        max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
    )
    assert again.headers[CACHE_STATUS_HEADER] == "exact"
    assert again.parse().choices[0].message.content == first.choices[0].message.content
    assert again.parse().choices[0].finish_reason == first.choices[0].finish_reason
    # usage: the generation's counts, and the hit reports the same (its stored generation's)
    usage = first.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= MAX_TOKENS
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert 0 <= (usage.prompt_tokens_details.cached_tokens or 0) <= usage.prompt_tokens
    hit_usage = again.parse().usage
    assert hit_usage is not None
    assert (hit_usage.prompt_tokens, hit_usage.completion_tokens) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    assert hit_usage.prompt_tokens_details and hit_usage.prompt_tokens_details.cached_tokens == 0


def test_a_streamed_chat_gives_the_same_text_in_chunks(oai: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": unique("Name a colour.")}]
    chunks = list(
        oai.chat.completions.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra and chunks[-1].model_extra["tiercache"]["cache_status"] == "miss"
    # stream_options.include_usage: one more chunk, no choices, the usage
    with_usage = list(
        oai.chat.completions.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert with_usage[-1].choices == [] and with_usage[-1].usage is not None
    assert with_usage[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in with_usage[:-1])
    whole = oai.chat.completions.create(
        model=BASE,
        messages=messages,
        max_tokens=MAX_TOKENS,  # type: ignore[arg-type]
    )
    assert whole.choices[0].message.content == text and text


def test_a_conversation_is_keyed_by_all_its_turns(oai: openai.OpenAI) -> None:
    """The exact key covers the earlier turns: the same last question after another
    conversation, or alone, is not that conversation's hit (and not a semantic one either: the
    earlier turns are in the semantic scope)."""
    question = unique("And in one word?")

    def ask(*earlier: dict[str, str]) -> tuple[str, str]:
        raw = oai.chat.completions.with_raw_response.create(
            model=BASE,
            messages=[*earlier, {"role": "user", "content": question}],  # type: ignore[list-item]
            max_tokens=MAX_TOKENS,
        )
        return raw.headers[CACHE_STATUS_HEADER], raw.parse().choices[0].message.content or ""

    system = {"role": "system", "content": "You answer briefly."}
    trip = [system, {"role": "user", "content": "Plan a trip to Rome."}]
    trip.append({"role": "assistant", "content": "Fly there, walk a lot."})
    poem = [system, {"role": "user", "content": "Write a poem."}]
    poem.append({"role": "assistant", "content": "Roses are red."})
    status, text = ask(*trip)
    assert status == "miss" and text
    assert ask(*trip) == ("exact", text)
    assert ask(*poem)[0] == "miss"
    assert ask()[0] == "miss"


def test_completions_and_no_cache(oai: openai.OpenAI) -> None:
    prompt = unique("Say hello.")
    plain = oai.completions.create(model=BASE, prompt=prompt, max_tokens=MAX_TOKENS)
    assert plain.object == "text_completion" and plain.choices[0].text
    fresh = oai.completions.with_raw_response.create(
        model=BASE,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        extra_headers={"Cache-Control": "no-cache"},
    )
    assert fresh.headers[CACHE_STATUS_HEADER] == "bypass"


def test_bad_requests_get_openai_errors(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model="no-such-model", prompt="x", max_tokens=MAX_TOKENS)
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        oai.completions.create(model=BASE, prompt="x", max_tokens=MAX_TOKENS, n=2)
    with pytest.raises(openai.BadRequestError, match="last message must be the user's"):
        oai.chat.completions.create(
            model=BASE,
            messages=[  # type: ignore[list-item]
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"},
            ],
        )
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the ensemble's own check
        oai.completions.create(model=BASE, prompt="x", max_tokens=10**6)


def test_sse_framing_and_headers(gateway: str) -> None:
    body = {
        "model": BASE,
        "messages": [{"role": "user", "content": unique("Count to three.")}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[-1]["choices"][0]["finish_reason"] and "tiercache" in events[-1]
    bad = httpx.post(
        f"{gateway}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_mid_stream_does_not_lose_the_answer(
    gateway: str, oai: openai.OpenAI
) -> None:
    """The caller closes the stream after its first event: the generation finishes for the
    cache, and the same request is then an exact hit."""
    prompt = unique("Describe the sea in a few words.")
    body = {"model": BASE, "prompt": prompt, "max_tokens": 12, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line)
        assert first.startswith("data: ")
    deadline = time.monotonic() + 120
    status = ""
    while time.monotonic() < deadline:
        raw = oai.completions.with_raw_response.create(model=BASE, prompt=prompt, max_tokens=12)
        status = raw.headers[CACHE_STATUS_HEADER]
        if status == "exact":
            break
        time.sleep(1)  # a "miss" here joined the same flight, or came before it was stored
    assert status == "exact"


def test_16_identical_requests_make_one_generation(gateway: str, server: TritonServer) -> None:
    prompt = unique("What is a cache?")
    before = settled_metric(server, "tiercache_llm_generations_total")

    async def all_at_once() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
        try:
            answers = await asyncio.gather(
                *(
                    client.completions.create(model=BASE, prompt=prompt, max_tokens=MAX_TOKENS)
                    for _ in range(16)
                )
            )
        finally:
            await client.close()
        return [a.choices[0].text for a in answers]

    texts = asyncio.run(all_at_once())
    assert len(set(texts)) == 1 and texts[0]
    assert settled_metric(server, "tiercache_llm_generations_total") - before == 1


def test_the_gateway_counts_what_it_served(gateway: str, oai: openai.OpenAI) -> None:
    """Its own Prometheus metrics on GET /metrics: the requests below, counted by route, code
    and cache status, and the chunks of a stream."""

    def value(name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(f"{gateway}/metrics").text.splitlines():
            if line.startswith((name + "{", name + " ")):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    chat = "/v1/chat/completions"
    counted = {
        "ok": ("tiercache_gateway_requests_total", {"route": chat, "code": "200"}),
        "bad": ("tiercache_gateway_requests_total", {"route": chat, "code": "400"}),
        "exact": ("tiercache_gateway_answers_total", {"cache_status": "exact"}),
        "chunks": ("tiercache_gateway_stream_chunks_total", {}),
        "timed": ("tiercache_gateway_request_seconds_count", {"route": chat}),
    }
    before = {k: value(name, **labels) for k, (name, labels) in counted.items()}
    messages = [{"role": "user", "content": unique("Name a fruit.")}]
    for stream in (False, False, True):
        oai.chat.completions.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=stream,
        )
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=BASE, messages=[], max_tokens=MAX_TOKENS)
    after = {k: value(name, **labels) for k, (name, labels) in counted.items()}
    delta = {k: after[k] - before[k] for k in counted}
    assert delta["ok"] == 3 and delta["bad"] == 1 and delta["timed"] == 4
    assert delta["exact"] == 2  # the repeat, and the stream of the same request
    assert delta["chunks"] >= 1


# -- the edge layer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edge(server: TritonServer) -> Iterator[str]:
    """A second gateway in front of the session's server, its edge layer on."""
    with running_gateway(server, frozenset(), edge=True) as url:
        yield url


@pytest.fixture(scope="module")
def admin(server: TritonServer) -> Iterator[TierCacheClient]:
    token = read_admin_token(server.admin_token_file)
    with TierCacheClient(server.grpc_url, timeout_s=300, admin_token=token) as c:
        yield c


def edge_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tiercache_gateway_edge_hits_total{")
    )


def test_the_edge_answers_exact_hits_as_the_ensemble_would_and_honours_invalidation(
    edge: str, server: TritonServer, client: TierCacheClient, admin: TierCacheClient
) -> None:
    """A warmed answer is the ensemble's exact hit and the edge's (counted at the edge, not in
    prompt_cache), whole and streamed; `no-cache` and another conversation pass the edge by;
    once invalidated (by the tag it was stored with) the edge serves it no more, and the
    ensemble generates, as it would without the edge."""
    tag = f"edge-{uuid.uuid4().hex[:8]}"
    prompt = unique("What colour is a lemon?")
    warmed = "Yellow (warmed at the edge test)."
    item = {"text_input": prompt, "answer": warmed, "max_tokens": MAX_TOKENS}
    report = admin.warm(prompts=[{**item, "cache_control": f"tag={tag}"}])
    assert (report["stored"], report["failed"]) == (1, 0)
    direct = client.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert (direct.cache_status, direct.text) == ("exact", warmed)

    oai = openai.OpenAI(base_url=f"{edge}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": prompt}]

    def ask(**extra: object) -> tuple[str, str]:
        raw = oai.chat.completions.with_raw_response.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            **extra,  # type: ignore[arg-type]
        )
        return raw.headers[CACHE_STATUS_HEADER], raw.parse().choices[0].message.content or ""

    hits = edge_hits(edge)
    ensemble_lookups = settled_metric(server, "tiercache_prompt_cache_requests_total")
    assert ask() == ("exact", warmed)
    chunks = list(
        oai.chat.completions.create(
            model=BASE,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            stream=True,
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == warmed
    assert chunks[-1].model_extra and chunks[-1].model_extra["tiercache"]["cache_status"] == "exact"
    assert edge_hits(edge) == hits + 2
    assert settled_metric(server, "tiercache_prompt_cache_requests_total") == ensemble_lookups

    # (no-store: a no-cache answer is stored otherwise, replacing the tagged one)
    assert ask(extra_headers={"Cache-Control": "no-cache, no-store"})[0] == "bypass"
    other = [{"role": "system", "content": "Answer in French."}, *messages]
    raw = oai.chat.completions.with_raw_response.create(
        model=BASE,
        messages=other,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
    )
    assert raw.headers[CACHE_STATUS_HEADER] == "miss"
    assert edge_hits(edge) == hits + 2

    admin.invalidate(tag=tag)
    status, text = ask()
    assert status == "miss" and text != warmed
    assert edge_hits(edge) == hits + 2
    again = client.generate_text(prompt, max_tokens=MAX_TOKENS)
    assert (again.cache_status, again.text) == ("exact", text)  # the ensemble stored it
    assert ask() == ("exact", text)  # and the edge serves the same
    assert edge_hits(edge) == hits + 3
    oai.close()


def test_feedback_through_the_gateway_on_an_edge_hit_and_an_ensemble_answer(edge: str) -> None:
    """Issue 19: the answer id reaches an HTTP caller in the `x-tiercache-answer-id` header and
    the `tiercache` field, from the ensemble and from the edge alike; `POST /v1/feedback` with
    `bad` stops the answer (the edge's copy too); a body that is not feedback is a 400."""
    prompt = unique("Name a fruit.")
    body = {"model": BASE, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}

    def ask() -> httpx.Response:
        response = httpx.post(f"{edge}/v1/chat/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        return response

    first = ask()
    answer_id = first.headers[ANSWER_ID_HEADER]
    assert first.json()["tiercache"]["answer_id"] == answer_id
    hits = edge_hits(edge)
    at_edge = ask()
    assert at_edge.headers[CACHE_STATUS_HEADER] == "exact" and edge_hits(edge) == hits + 1
    edge_id = at_edge.headers[ANSWER_ID_HEADER]
    assert edge_id != answer_id

    verdict = httpx.post(f"{edge}/v1/feedback", json={"answer_id": edge_id, "verdict": "bad"})
    assert verdict.status_code == 200, verdict.text
    assert verdict.json()["invalidated"] is True
    assert ask().headers[CACHE_STATUS_HEADER] == "miss"

    for bad_body in ({"answer_id": edge_id}, {"answer_id": edge_id, "verdict": "meh"}, [1]):
        refused = httpx.post(f"{edge}/v1/feedback", json=bad_body)
        assert refused.status_code == 400, refused.text
    forged = httpx.post(f"{edge}/v1/feedback", json={"answer_id": "a1.xyz", "verdict": "bad"})
    assert forged.status_code == 400 and "not an answer id" in forged.text
