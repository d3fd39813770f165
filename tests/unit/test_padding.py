"""Response-time padding (tiercache.padding) with a fake clock and a fake scheduler: nothing
sleeps; the timer thread is only checked for what `close()` guarantees."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest

from tiercache.config import LlmConfig
from tiercache.errors import ConfigError
from tiercache.exact.flights import EngineUsage
from tiercache.exact.keys import tenant_scope
from tiercache.padding import (
    MASKED_STATUS,
    Action,
    DueQueue,
    MaskedResponder,
    PaddedResponder,
    PaddingPolicy,
    ResponseTimer,
    uniform_source,
)
from tiercache.stages.parts import padding_policy

SECRET = b"s" * 32


class FakeClock:
    def __init__(self, now_s: float = 100.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@dataclass
class FakeScheduler:
    """Records what was scheduled; `run_due(now)` runs what a real timer would have by then."""

    queue: DueQueue = field(default_factory=DueQueue)

    def schedule(self, due_s: float, action: Action) -> None:
        self.queue.push(due_s, action)

    def run_due(self, now_s: float) -> int:
        due = self.queue.pop_due(now_s)
        for action in due:
            action()
        return len(due)


@dataclass
class RecordingResponder:
    sent: list[tuple] = field(default_factory=list)
    cancelled: bool = False

    def is_cancelled(self) -> bool:
        return self.cancelled

    def send_chunk(self, text: str) -> None:
        self.sent.append(("chunk", text))

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        self.sent.append(("final", text, status, similarity, usage))
        if finish_reason is not None:
            self.sent.append(("finish", finish_reason))

    def send_cancelled(self) -> None:
        self.sent.append(("cancelled",))

    def send_error(self, exc: BaseException) -> None:
        self.sent.append(("error", str(exc)))


def padded(release_s: float = 100.5, now_s: float = 100.0):
    clock, scheduler, inner = FakeClock(now_s), FakeScheduler(), RecordingResponder()
    return PaddedResponder(inner, release_s, scheduler, clock), clock, scheduler, inner


def test_policy_pads_untrusted_tenants_only_when_on() -> None:
    trusted = tenant_scope(SECRET, "ops")
    policy = PaddingPolicy(floor_s=0.2, jitter_s=0.1, trusted=frozenset({trusted}))
    assert policy.pads(tenant_scope(SECRET, "public"))
    assert policy.pads(tenant_scope(SECRET, ""))  # the anonymous tenant is untrusted too
    assert not policy.pads(trusted)
    assert not PaddingPolicy().pads(tenant_scope(SECRET, "public"))  # floor 0: off


def test_release_time_is_arrival_plus_floor_plus_scaled_jitter() -> None:
    policy = PaddingPolicy(floor_s=0.2, jitter_s=0.1)
    assert policy.release_at(10.0, lambda: 0.0) == pytest.approx(10.2)
    assert policy.release_at(10.0, lambda: 0.5) == pytest.approx(10.25)
    assert policy.release_at(10.0, lambda: 0.999) < 10.3


def test_policy_from_config_normalizes_trusted_names_into_scopes() -> None:
    config = LlmConfig(
        hit_padding_ms=250, hit_padding_jitter_ms=50, trusted_tenants=" ops , ｏｐｓ2"
    )
    policy = padding_policy(config, SECRET)
    assert (policy.floor_s, policy.jitter_s) == (0.25, 0.05)
    # NFKC folds the full-width name, as prompt_cache folds the tenant input
    assert policy.trusted == {tenant_scope(SECRET, "ops"), tenant_scope(SECRET, "ops2")}
    with pytest.raises(ConfigError, match="hit_padding_ms"):
        LlmConfig(hit_padding_ms=-1)  # refused by the config itself


def test_a_hit_is_held_until_the_release_time() -> None:
    responder, clock, scheduler, inner = padded(release_s=100.5)
    responder.send_final("cached", "exact")
    assert inner.sent == []
    assert scheduler.queue.next_due() == 100.5
    assert scheduler.run_due(100.4) == 0 and inner.sent == []
    assert scheduler.run_due(100.5) == 1
    assert inner.sent == [("final", "cached", "exact", None, None)]


def test_held_stream_chunks_leave_in_order_then_later_ones_pass_through() -> None:
    responder, clock, scheduler, inner = padded(release_s=100.5)
    responder.send_chunk("a")
    responder.send_chunk("b")
    assert len(scheduler.queue) == 1  # one release per request, however many responses wait
    scheduler.run_due(100.5)
    clock.now_s = 100.6
    responder.send_chunk("c")
    responder.send_final(None, "miss", usage=EngineUsage(32, 5))
    assert inner.sent == [
        ("chunk", "a"),
        ("chunk", "b"),
        ("chunk", "c"),
        ("final", None, "miss", None, EngineUsage(32, 5)),
    ]


def test_the_final_response_keeps_its_finish_reason() -> None:
    responder, _, scheduler, inner = padded()
    responder.send_final("I can't help with that.", "miss", finish_reason="content_filter")
    scheduler.run_due(100.5)
    assert inner.sent[-1] == ("finish", "content_filter")


def test_a_response_after_the_release_time_is_not_delayed() -> None:
    responder, clock, scheduler, inner = padded(release_s=100.5)
    clock.now_s = 101.0  # a miss slower than the floor
    responder.send_final("generated", "miss")
    assert inner.sent == [("final", "generated", "miss", None, None)]
    assert len(scheduler.queue) == 0


def test_errors_and_cancellations_keep_their_place_behind_held_responses() -> None:
    responder, _, scheduler, inner = padded()
    responder.send_chunk("partial")
    responder.send_error(RuntimeError("engine died"))
    scheduler.run_due(100.5)
    assert inner.sent == [("chunk", "partial"), ("error", "engine died")]
    responder2, _, scheduler2, inner2 = padded()
    inner2.cancelled = True
    assert responder2.is_cancelled()
    responder2.send_cancelled()
    scheduler2.run_due(100.5)
    assert inner2.sent == [("cancelled",)]


def test_due_queue_orders_by_time_then_by_push_order() -> None:
    queue, ran = DueQueue(), []
    queue.push(3.0, lambda: ran.append("late"))
    queue.push(1.0, lambda: ran.append("first"))
    queue.push(1.0, lambda: ran.append("second"))
    for action in queue.pop_due(2.0):
        action()
    assert ran == ["first", "second"] and queue.next_due() == 3.0


def test_timer_close_sends_what_it_still_holds_and_later_schedules_run_at_once() -> None:
    timer = ResponseTimer(clock=FakeClock(0.0))
    ran: list[str] = []
    timer.schedule(1e9, lambda: ran.append("held"))
    assert timer.pending() == 1 and ran == []
    timer.close()
    assert ran == ["held"]
    timer.schedule(1e9, lambda: ran.append("after close"))
    assert ran == ["held", "after close"]


def test_timer_thread_runs_an_action_that_is_already_due() -> None:
    timer = ResponseTimer(clock=FakeClock(50.0))
    done = threading.Event()
    try:
        timer.schedule(10.0, done.set)  # due in the fake clock's past
        assert done.wait(timeout=10), "the timer thread did not run a due action"
    finally:
        timer.close()


def test_a_failing_send_does_not_stop_the_others() -> None:
    timer = ResponseTimer(clock=FakeClock(0.0))
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("sender closed")

    timer.schedule(5.0, boom)
    timer.schedule(6.0, lambda: ran.append("next"))
    timer.close()
    assert ran == ["next"]


def test_a_masked_hit_and_a_masked_miss_send_the_same_shape() -> None:
    """A padded tenant's hit (one final with the text, status and similarity) and its streamed
    miss (chunks, then a final with prompt-token counts and a finish reason) reach the client
    alike: one final response with the whole text and status "masked", nothing else."""
    hit, miss = RecordingResponder(), RecordingResponder()
    MaskedResponder(hit).send_final("Paris.", "semantic", 0.97)
    masked_miss = MaskedResponder(miss)
    masked_miss.send_chunk("Par")
    masked_miss.send_chunk("is.")
    masked_miss.send_final(None, "miss", None, (12, 3), finish_reason="stop")
    assert hit.sent == miss.sent == [("final", "Paris.", MASKED_STATUS, None, None)]
    exact, fresh = RecordingResponder(), RecordingResponder()
    MaskedResponder(exact).send_final("Paris.", "exact")
    MaskedResponder(fresh).send_final("Paris.", "miss", None, (0, 15), finish_reason="length")
    assert exact.sent == fresh.sent


def test_the_end_of_a_held_request_is_reported_once_after_its_last_response() -> None:
    """llm counts held padded requests (at most MAX_HELD_PADDED): each is counted out once its
    final, error or cancellation has gone, not when its worker returned (the answers held until
    the floor were not counted at all)."""
    for last in ("final", "error", "cancelled"):
        ended: list[int] = []
        clock, scheduler, inner = FakeClock(100.0), FakeScheduler(), RecordingResponder()
        responder = PaddedResponder(
            inner, 100.5, scheduler, clock, on_done=lambda e=ended: e.append(1)
        )
        responder.send_chunk("a")
        if last == "final":
            responder.send_final("b", "miss")
        elif last == "error":
            responder.send_error(RuntimeError("boom"))
        else:
            responder.send_cancelled()
        assert ended == []  # held: not gone yet
        scheduler.run_due(100.5)
        assert ended == [1], last


def test_a_client_gone_while_its_answer_is_held_gets_the_cancellation_only() -> None:
    ended: list[int] = []
    clock, scheduler, inner = FakeClock(100.0), FakeScheduler(), RecordingResponder()
    responder = PaddedResponder(inner, 100.5, scheduler, clock, on_done=lambda: ended.append(1))
    responder.send_chunk("the answer")
    responder.send_final(" in full", "exact")
    inner.cancelled = True  # the client left during the hold
    scheduler.run_due(100.5)
    assert inner.sent == [("cancelled",)] and ended == [1]


def test_the_jitter_is_the_systems_unless_seeded() -> None:
    """A Mersenne Twister's state can be rebuilt from its outputs; the system's cannot."""
    import random
    import secrets

    draw = uniform_source()
    assert isinstance(getattr(draw, "__self__", None), secrets.SystemRandom)
    assert 0.0 <= draw() < 1.0
    assert uniform_source(7)() == random.Random(7).random()
