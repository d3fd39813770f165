"""generate_with_adapter: one retry with weights when the engine lost the adapter, never more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tiercache.adapter_types import AdapterRef, not_in_engine_message
from tiercache.engine.adapter_call import EngineLora, adapter_ref, generate_with_adapter
from tiercache.engine.events import StreamEvent
from tiercache.errors import NotFound, Unavailable
from tiercache.exact.request import GenerationRequest

REF = AdapterRef("french", 3, "ab" * 32)
WITH_ADAPTER = GenerationRequest("hi", lora_name="french", lora_task_id=3, lora_digest="ab" * 32)
WEIGHTS = EngineLora('{"peft_type": "LORA"}', b"safetensors", ("cd" * 32,))


class Engine:
    """Holds adapters by digest; answers like torch_llm for one it does not hold."""

    def __init__(self, holds: bool, turns: bool = False) -> None:
        self.holds = holds
        self.turns = turns  # first an empty event, as EngineBls yields once the call has its turn
        self.calls: list[EngineLora] = []

    def __call__(self, request: GenerationRequest, lora: EngineLora) -> Iterator[StreamEvent]:
        self.calls.append(lora)
        if self.turns:
            yield StreamEvent("")
        ref = adapter_ref(request)
        if ref is not None and not self.holds and not lora.loads:
            raise NotFound(not_in_engine_message(ref))
        self.holds = True
        yield StreamEvent("a", None, 1, 2)
        yield StreamEvent("b", "stop", 2, 2)


def fetch_ok(ref: AdapterRef) -> EngineLora:
    assert ref == REF
    return WEIGHTS


def test_held_adapter_runs_once_without_weights() -> None:
    engine = Engine(holds=True)
    events = list(generate_with_adapter(engine, fetch_ok, WITH_ADAPTER, EngineLora()))
    assert [e.text for e in events] == ["a", "b"]
    assert engine.calls == [EngineLora()]


def test_lost_adapter_is_retried_once_with_fetched_weights() -> None:
    engine = Engine(holds=False)
    events = list(generate_with_adapter(engine, fetch_ok, WITH_ADAPTER, EngineLora()))
    assert [e.finish_reason for e in events] == [None, "stop"]
    assert engine.calls == [EngineLora(), WEIGHTS]


def test_no_retry_when_weights_were_already_sent() -> None:
    def refusing(request: GenerationRequest, lora: EngineLora) -> Iterator[StreamEvent]:
        raise NotFound(not_in_engine_message(REF))
        yield  # pragma: no cover - makes this a generator

    with pytest.raises(NotFound, match="not found in cache"):
        list(generate_with_adapter(refusing, fetch_ok, WITH_ADAPTER, WEIGHTS))


def test_second_refusal_reaches_the_caller() -> None:
    calls = []

    def refusing(request: GenerationRequest, lora: EngineLora) -> Iterator[StreamEvent]:
        calls.append(lora)
        if not lora.loads:
            raise NotFound(not_in_engine_message(REF))
        raise Unavailable("engine torch_llm: out of memory")
        yield  # pragma: no cover

    with pytest.raises(Unavailable, match="out of memory"):
        list(generate_with_adapter(refusing, fetch_ok, WITH_ADAPTER, EngineLora()))
    assert len(calls) == 2


def test_other_errors_and_base_requests_are_not_retried() -> None:
    calls = []

    def failing(request: GenerationRequest, lora: EngineLora) -> Iterator[StreamEvent]:
        calls.append(lora)
        raise NotFound(not_in_engine_message(REF))
        yield  # pragma: no cover

    base = GenerationRequest("hi")
    with pytest.raises(NotFound):
        list(generate_with_adapter(failing, fetch_ok, base, EngineLora()))
    assert len(calls) == 1


def test_a_lost_adapter_is_retried_after_the_calls_turn_and_the_turns_pass_through() -> None:
    """EngineBls yields an empty event once its call has an engine stream (so that a caller
    nobody waits for any more closes it there); the engine's refusal comes after it, and is
    still retried once with the weights; the empty events reach the caller, not as output."""
    engine = Engine(holds=False, turns=True)
    events = list(generate_with_adapter(engine, fetch_ok, WITH_ADAPTER, EngineLora()))
    assert [(e.text, e.finish_reason) for e in events] == [
        ("", None),
        ("", None),
        ("a", None),
        ("b", "stop"),
    ]
    assert engine.calls == [EngineLora(), WEIGHTS]
