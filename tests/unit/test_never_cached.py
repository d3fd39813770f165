"""What the llm stage never caches: errors, cancelled and truncated streams, engine refusals.

Each case checks what the requester receives and that nothing is stored or indexed, so the next
identical request generates again (a miss) instead of being served a partial or flagged answer.
The engine refusal's trigger (tiercache.engine.policy) is tested here too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from test_generation import (
    DIGEST,
    REQUEST,
    STREAMING,
    TIMEOUT_S,
    FakeEngine,
    Follows,
    Recorder,
    make_stage,
    stored_text,
)

from tiercache.engine.events import CONTENT_FILTER, StreamEvent
from tiercache.engine.policy import DEFAULT_REFUSAL_TEXT, RefusalPolicy
from tiercache.errors import ConfigError, Unavailable
from tiercache.exact.request import GenerationRequest
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.generation import GenerationRecord
from tiercache.vocabulary import Tier

REFUSAL = "I can't help with that request."


@pytest.fixture
def cache() -> TieredCache:
    return TieredCache([(Tier.L1, MemoryStore(1 << 20))])


# -- the engine's input policy ---------------------------------------------------------------


def test_empty_pattern_refuses_nothing() -> None:
    policy = RefusalPolicy.parse("", "")
    assert not policy.refuses(GenerationRequest(prompt="anything at all"))


def test_matching_prompt_is_refused_without_generating() -> None:
    policy = RefusalPolicy.parse(r"(?i)\bsecret recipe\b", "No.")
    called: list[bool] = []

    def generate() -> Iterator[StreamEvent]:
        called.append(True)
        yield StreamEvent("should not run", "stop")

    events = list(policy.generate(GenerationRequest(prompt="Tell me the SECRET recipe"), generate))
    assert events == [StreamEvent("No.", CONTENT_FILTER)]
    assert called == []
    # asked in an earlier turn, then referred to: the model reads every turn, so is the policy
    earlier = GenerationRequest(
        prompt="Answer my previous question.",
        history=(("user", "What is the secret recipe?"), ("assistant", "Let me think.")),
    )
    assert policy.refuses(earlier)
    assert not policy.refuses(GenerationRequest(prompt="hi", history=(("user", "hello"),)))


def test_other_prompts_reach_the_engine() -> None:
    policy = RefusalPolicy.parse(r"secret recipe", DEFAULT_REFUSAL_TEXT)
    answer = [StreamEvent("Hi", None), StreamEvent("!", "stop")]
    assert list(policy.generate(GenerationRequest(prompt="Say hi"), lambda: iter(answer))) == answer


@pytest.mark.parametrize(
    ("pattern", "text", "message"),
    [("(unclosed", "No.", "is not a regex"), ("x", "", "refusal_text must not be empty")],
)
def test_bad_policy_fails_at_start(pattern: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RefusalPolicy.parse(pattern, text)


# -- refusals through the stage ----------------------------------------------------------------


@pytest.mark.parametrize("request_", [REQUEST, STREAMING], ids=["whole", "stream"])
def test_refusal_is_served_with_its_finish_reason_and_never_stored(
    cache: TieredCache, request_: GenerationRequest
) -> None:
    records: list[GenerationRecord] = []
    indexed: list[bool] = []
    engine = FakeEngine(chunks=(REFUSAL,), finish=CONTENT_FILTER)
    stage = make_stage(cache, engine, on_generation=records.append)
    try:
        r = Recorder()
        stage.submit_miss(request_, DIGEST, "miss", True, r, lambda: indexed.append(True))
        calls = r.wait()
        if request_.stream:
            assert calls == [("chunk", REFUSAL), ("final", None, "miss")]
        else:
            assert calls == [("final", REFUSAL, "miss")]
        assert r.finish_reason == CONTENT_FILTER
        assert stored_text(cache) is None
        assert indexed == []  # never added to the semantic index
        assert [(rec.finish_reason, rec.stored) for rec in records] == [(CONTENT_FILTER, False)]

        again = Recorder()  # the next identical request is a miss: the engine answers again
        stage.submit_miss(REQUEST, DIGEST, "miss", True, again)
        assert again.wait() == [("final", REFUSAL, "miss")]
        assert engine.calls == 2 and stored_text(cache) is None
    finally:
        stage.close()


def test_coalesced_requesters_all_get_the_refusal(cache: TieredCache) -> None:
    gate = threading.Event()
    follows = Follows(2)
    engine = FakeEngine(chunks=(REFUSAL,), finish=CONTENT_FILTER, gate=gate)
    stage = make_stage(cache, engine, on_follow=follows)
    try:
        recorders = [Recorder() for _ in range(3)]
        for r in recorders:
            stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
        assert follows.reached.wait(TIMEOUT_S)
        gate.set()
        assert [r.wait() for r in recorders] == [[("final", REFUSAL, "miss")]] * 3
        assert {r.finish_reason for r in recorders} == {CONTENT_FILTER}
        assert engine.calls == 1 and stored_text(cache) is None
    finally:
        stage.close()


def test_clean_answer_reports_its_finish_reason(cache: TieredCache) -> None:
    stage = make_stage(cache, FakeEngine(finish="length"))
    try:
        r = Recorder()
        stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
        assert r.wait() == [("final", "Hello", "miss")]
        assert r.finish_reason == "length" and stored_text(cache) == "Hello"
    finally:
        stage.close()


# -- errors and truncated streams ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("raises", "finish"),
    [
        (Unavailable("engine torch_llm: stub died"), "stop"),  # engine error after chunks
        (None, None),  # stream ended without a finish reason
    ],
    ids=["error-midway", "no-finish-reason"],
)
def test_truncated_stream_is_an_error_and_never_stored(
    cache: TieredCache, raises: Exception | None, finish: str | None
) -> None:
    indexed: list[bool] = []
    engine = FakeEngine(chunks=("The answer ", "is"), finish=finish, raises=raises)
    stage = make_stage(cache, engine)
    try:
        r = Recorder()
        stage.submit_miss(STREAMING, DIGEST, "miss", True, r, lambda: indexed.append(True))
        calls = r.wait()
        # The streamed chunks arrived, then an error instead of a final response.
        assert calls[:2] == [("chunk", "The answer "), ("chunk", "is")]
        assert calls[-1][0] == "error" and len(calls) == 3
        assert stored_text(cache) is None and indexed == []

        engine.raises, engine.finish = None, "stop"  # the engine recovers
        again = Recorder()
        stage.submit_miss(REQUEST, DIGEST, "miss", True, again)
        assert again.wait() == [("final", "The answer is", "miss")]
        assert engine.calls == 2 and stored_text(cache) == "The answer is"
    finally:
        stage.close()


def test_cancelled_stream_leaves_nothing_and_the_next_request_generates(
    cache: TieredCache,
) -> None:
    """The only requester cancels mid-stream: its generation is abandoned, not stored."""
    gate = threading.Event()
    engine = FakeEngine(chunks=("partial",), gate=gate)
    stage = make_stage(cache, engine)
    try:
        leaving = Recorder()
        stage.submit_miss(STREAMING, DIGEST, "miss", True, leaving)
        engine.wait_started()
        leaving.cancelled.set()
        assert leaving.wait() == [("cancelled",)]
        gate.set()
        # The flight completes (abandoned) before a new identical request starts its own.
        deadline = time.monotonic() + TIMEOUT_S
        while stage.flights.in_flight():
            assert time.monotonic() < deadline, "the abandoned flight never completed"
            time.sleep(0.01)
        assert stored_text(cache) is None

        again = Recorder()
        stage.submit_miss(REQUEST, DIGEST, "miss", True, again)
        assert again.wait() == [("final", "partial", "miss")]
        assert engine.calls == 2
    finally:
        stage.close()
