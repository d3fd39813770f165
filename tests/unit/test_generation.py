"""The llm stage (tiercache.generation) with a fake engine and fake responders."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tiercache.engine.events import StreamEvent
from tiercache.errors import TierCacheError, Unavailable
from tiercache.exact.confidence import ConfidencePolicy
from tiercache.exact.flights import EngineUsage
from tiercache.exact.keys import Digest
from tiercache.exact.leases import Lease, LeaseState
from tiercache.exact.request import GenerationRequest
from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.generation import GenerationRecord, Generations
from tiercache.vocabulary import Tier

TIMEOUT_S = 10.0
DIGEST = Digest("d" * 64)
REQUEST = GenerationRequest(prompt="hi")
STREAMING = GenerationRequest(prompt="hi", stream=True)


class Recorder:
    """A Responder that records every call; `done` is set on the last one."""

    def __init__(self, cancelled: bool = False) -> None:
        self._lock = threading.Lock()
        self.calls: list[tuple] = []
        self.done = threading.Event()
        self.cancelled = threading.Event()
        if cancelled:
            self.cancelled.set()

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()

    def _record(self, *call: object, last: bool = False) -> None:
        with self._lock:
            self.calls.append(call)
        if last:
            self.done.set()

    def send_chunk(self, text: str) -> None:
        self._record("chunk", text)

    def send_final(
        self,
        text: str | None,
        status: str,
        similarity: float | None = None,
        usage: EngineUsage | None = None,
        finish_reason: str | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> None:
        self.usage = usage
        self.finish_reason = finish_reason
        self.tokens = tokens
        if similarity is None:
            self._record("final", text, status, last=True)
        else:
            self._record("final", text, status, similarity, last=True)

    def send_cancelled(self) -> None:
        self._record("cancelled", last=True)

    def send_error(self, exc: BaseException) -> None:
        self._record("error", exc, last=True)

    def wait(self) -> list[tuple]:
        assert self.done.wait(TIMEOUT_S), f"no final response; calls so far: {self.calls}"
        with self._lock:
            return list(self.calls)


@dataclass
class FakeEngine:
    """A GenerateFn: yields `chunks`, then a finish event; can wait on `gate` first."""

    chunks: tuple[str, ...] = ("Hel", "", "lo")
    finish: str | None = "stop"
    raises: BaseException | None = None
    gate: threading.Event | None = None
    mean_logprob: float | None = None
    engine_s: float | None = None
    calls: int = 0
    started: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        with self._lock:
            self.calls += 1
        self.started.release()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT_S)
        for chunk in self.chunks:
            yield StreamEvent(chunk)
        if self.raises is not None:
            raise self.raises
        if self.finish is not None:
            yield StreamEvent(
                "",
                self.finish,
                generated_tokens=len(self.chunks),
                prompt_tokens=40,
                reused_tokens=32,
                computed_tokens=8,
                mean_logprob=self.mean_logprob,
                engine_s=self.engine_s,
            )

    def wait_started(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.started.acquire(timeout=TIMEOUT_S)


class Follows:
    """on_follow callback: `reached` is set once `target` followers have joined."""

    def __init__(self, target: int) -> None:
        self.target, self.count = target, 0
        self.reached = threading.Event()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.count += 1
            if self.count >= self.target:
                self.reached.set()


@pytest.fixture
def cache() -> TieredCache:
    return TieredCache([(Tier.L1, MemoryStore(1 << 20))])


def make_stage(cache: TieredCache, engine: FakeEngine, **kwargs: object) -> Generations:
    return Generations(cache, engine, **kwargs)  # type: ignore[arg-type]


def stored_text(cache: TieredCache, digest: str = DIGEST) -> str | None:
    found = cache.get(digest)
    return None if found is None else found.entry.text


def test_identical_misses_coalesce_into_one_generation(cache: TieredCache) -> None:
    engine = FakeEngine(gate=threading.Event())
    follows = Follows(15)
    records: list[GenerationRecord] = []
    stage = make_stage(cache, engine, on_follow=follows, on_generation=records.append)
    responders = [Recorder() for _ in range(16)]
    for r in responders:
        stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert follows.reached.wait(TIMEOUT_S)
    assert engine.gate is not None
    engine.gate.set()
    for r in responders:
        assert r.wait() == [("final", "Hello", "miss")]
        assert r.usage == EngineUsage(32, 8)  # every subscriber: the one generation's prefix reuse
    stats = stage.stats()
    assert engine.calls == 1
    assert (stats.generations, stats.coalesced, stats.write_backs, stats.in_flight) == (1, 15, 1, 0)
    assert stored_text(cache) == "Hello"
    assert len(records) == 1 and records[0].stored and records[0].finish_reason == "stop"
    stage.close()


@pytest.mark.parametrize("by", ["tenant", "key", "tag"])
def test_a_miss_after_an_invalidation_does_not_join_the_generation_it_kills(
    cache: TieredCache, by: str
) -> None:
    """A generation under way when its tenant (key, tag) is invalidated is not stored; a
    request arriving after the invalidation joined it all the same and was served the answer
    the invalidation killed. It starts its own generation now; the first one's request keeps
    its answer (it asked before the invalidation)."""
    from tiercache.exact.invalidation import Invalidator

    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine)
    request = dataclasses.replace(REQUEST, tenant_scope="scope-a")
    before, after = Recorder(), Recorder()
    stage.submit_miss(request, DIGEST, "miss", True, before, tags=("faq",))
    engine.wait_started()
    cache.now = lambda: time.time() + 1.0  # type: ignore[method-assign] # past the skew
    getattr(Invalidator(cache), by)({"tenant": "scope-a", "key": DIGEST, "tag": "faq"}[by])
    cache.now = lambda: time.time() + 2.0  # type: ignore[method-assign] # later still
    stage.submit_miss(request, DIGEST, "miss", True, after)  # without the tag: the flight's
    engine.wait_started()  # a second generation, not a follower of the first
    assert engine.gate is not None
    engine.gate.set()
    assert before.wait() == [("final", "Hello", "miss")]
    assert after.wait() == [("final", "Hello", "miss")]
    assert (engine.calls, stage.stats().coalesced) == (2, 0)
    assert stored_text(cache) == "Hello"  # the second answer, made after the invalidation
    found = cache.get(DIGEST)
    assert found is not None and found.entry.tags == ()  # the second flight's own tags
    stage.close()


def test_stream_sends_chunks_then_final_without_text(cache: TieredCache) -> None:
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(STREAMING, DIGEST, "miss", True, r)
    assert r.wait() == [("chunk", "Hel"), ("chunk", "lo"), ("final", None, "miss")]
    stage.close()


def test_non_stream_sends_one_final_with_text(cache: TieredCache) -> None:
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "bypass", True, r)
    assert r.wait() == [("final", "Hello", "bypass")]
    stage.close()


def test_a_value_made_for_another_tenant_or_adapter_is_generated_again_and_written_over(
    cache: TieredCache,
) -> None:
    """llm's re-check before generating served whatever sat under the key: another tenant's
    answer moved there (L2's checksum does not cover the key) went out as this request's,
    with no engine call, and stayed. It is generated again now and written over."""
    for moved in ({"tenant_scope": "b" * 64}, {"adapter": "c" * 64}):
        cache.put(DIGEST, "tenant B's answer", **moved)  # type: ignore[arg-type]
        engine = FakeEngine()
        stage = make_stage(cache, engine)
        r = Recorder()
        stage.submit_miss(
            dataclasses.replace(REQUEST, tenant_scope="a" * 64), DIGEST, "miss", True, r
        )
        assert r.wait() == [("final", "Hello", "miss")] and engine.calls == 1
        assert stored_text(cache) == "Hello"
        stage.close()


def test_serve_hit_is_one_final() -> None:
    r = Recorder()
    Generations.serve_hit("cached", "exact", r)
    assert r.wait() == [("final", "cached", "exact")]


def test_uncacheable_is_never_coalesced_or_stored(cache: TieredCache) -> None:
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine)
    responders = [Recorder(), Recorder()]
    for r in responders:
        stage.submit_miss(REQUEST, None, "bypass", True, r)
    engine.wait_started(2)  # both generations run at once: nothing joined the other
    assert engine.gate is not None
    engine.gate.set()
    for r in responders:
        assert r.wait() == [("final", "Hello", "bypass")]
    stats = stage.stats()
    assert (engine.calls, stats.coalesced, stats.write_backs) == (2, 0, 0)
    l1 = cache.store(Tier.L1)
    assert l1 is not None and l1.stats().entries == 0
    stage.close()


def test_write_back_false_is_not_stored(cache: TieredCache) -> None:
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", False, r)
    assert r.wait() == [("final", "Hello", "miss")]
    assert stored_text(cache) is None
    assert stage.stats().write_backs == 0
    stage.close()


@pytest.mark.parametrize(
    "raises", [RuntimeError("boom"), Unavailable("engine gone")], ids=["runtime", "tiercache"]
)
def test_engine_error_reaches_every_subscriber(cache: TieredCache, raises: Exception) -> None:
    engine = FakeEngine(raises=raises, gate=threading.Event())
    follows = Follows(2)
    stage = make_stage(cache, engine, on_follow=follows)
    responders = [Recorder() for _ in range(3)]
    for r in responders:
        stage.submit_miss(STREAMING, DIGEST, "miss", True, r)
    assert follows.reached.wait(TIMEOUT_S)
    assert engine.gate is not None
    engine.gate.set()
    for r in responders:
        calls = r.wait()
        assert calls[:-1] == [("chunk", "Hel"), ("chunk", "lo")]
        kind, exc = calls[-1]
        assert kind == "error" and isinstance(exc, Unavailable)
        assert ("RuntimeError" if isinstance(raises, RuntimeError) else "engine gone") in str(exc)
        assert "boom" not in str(exc)  # an unexpected error's text stays in the log
    assert engine.calls == 1
    assert stored_text(cache) is None
    assert stage.stats().write_backs == 0
    stage.close()


@pytest.mark.parametrize("finish", ["cancelled", None, "weird"])
def test_unclean_finish_is_not_stored(cache: TieredCache, finish: str | None) -> None:
    records: list[GenerationRecord] = []
    stage = make_stage(cache, FakeEngine(finish=finish), on_generation=records.append)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    kind, exc = r.wait()[-1]
    assert kind == "error" and isinstance(exc, TierCacheError)
    assert stored_text(cache) is None
    assert stage.stats().write_backs == 0
    assert all(not rec.stored for rec in records)
    stage.close()


def test_length_finish_is_stored(cache: TieredCache) -> None:
    stage = make_stage(cache, FakeEngine(finish="length"))
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "Hello", "miss")]
    found = cache.get(DIGEST)
    assert found is not None and found.entry.finish_reason == "length"
    stage.close()


def test_cancelled_subscriber_gets_cancelled_others_get_text(cache: TieredCache) -> None:
    engine = FakeEngine(gate=threading.Event())
    follows = Follows(1)
    stage = make_stage(cache, engine, on_follow=follows)
    staying, leaving = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, staying)
    engine.wait_started()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, leaving)
    assert follows.reached.wait(TIMEOUT_S)
    leaving.cancelled.set()
    assert leaving.wait() == [("cancelled",)]
    assert engine.gate is not None
    engine.gate.set()
    assert staying.wait() == [("final", "Hello", "miss")]
    assert engine.calls == 1
    assert stored_text(cache) == "Hello"
    stage.close()


def test_every_subscriber_cancelled_is_not_stored(cache: TieredCache) -> None:
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    engine.wait_started()
    r.cancelled.set()
    assert r.wait() == [("cancelled",)]
    assert engine.gate is not None
    engine.gate.set()
    stage.close()  # waits for the generation to end
    assert stored_text(cache) is None
    assert stage.stats().write_backs == 0


class SteppedEngine:
    """A GenerateFn of 1,000 one-token steps that waits on `gate` after its first; `closed` is
    set when its stream is closed (or ends), as a BLS stream's closing cancels the call."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.first = threading.Event()
        self.closed = threading.Event()
        self.steps = 0

    def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        try:
            for i in range(1000):
                if i == 1:
                    self.first.set()
                    assert self.gate.wait(TIMEOUT_S)
                self.steps += 1
                yield StreamEvent("x")
            yield StreamEvent("", "length", generated_tokens=1000)
        finally:
            self.closed.set()


def test_a_generation_every_requester_left_stops_and_closes_its_stream(
    cache: TieredCache,
) -> None:
    """The only requester cancels mid-answer: the generation stops at the next step and its
    stream is closed (the engine's call cancelled) instead of running to max_tokens for
    nobody; nothing is stored."""
    engine = SteppedEngine()
    stage = make_stage(cache, engine)  # type: ignore[arg-type]
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert engine.first.wait(TIMEOUT_S)
    r.cancelled.set()
    assert r.wait() == [("cancelled",)]
    engine.gate.set()
    assert engine.closed.wait(TIMEOUT_S)
    assert engine.steps < 10
    stage.close()
    assert stored_text(cache) is None


def test_a_miss_left_before_its_engine_run_starts_runs_none(cache: TieredCache) -> None:
    """One engine worker, busy with a generation whose requester left; a second miss queues
    behind it and its requester leaves too: when its turn comes it gets no engine run (before,
    every miss queued and cancelled still ran to the end, past the pending bound)."""
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine, max_workers=1)
    first, queued = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, first)
    engine.wait_started()
    first.cancelled.set()
    assert first.wait() == [("cancelled",)]  # its reader is gone; its producer still runs
    other = GenerationRequest(prompt="another question")
    stage.submit_miss(other, Digest("e" * 64), "miss", True, queued)
    queued.cancelled.set()
    assert queued.wait() == [("cancelled",)]
    assert engine.gate is not None
    engine.gate.set()
    stage.close()
    assert engine.calls == 1
    assert stored_text(cache) is None and stored_text(cache, "e" * 64) is None


def test_entry_stored_after_lookup_skips_generation(cache: TieredCache) -> None:
    engine = FakeEngine()
    cache.put(DIGEST, "from cache")
    stage = make_stage(cache, engine)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "from cache", "miss")]
    assert engine.calls == 0
    assert stage.stats().generations == 0
    stage.close()


def test_failed_write_back_still_answers(cache: TieredCache) -> None:
    class BrokenStore(MemoryStore):
        def put(self, key: str, entry: object) -> None:
            raise OSError("disk full")

    broken = TieredCache([(Tier.L2, BrokenStore(1 << 20))])
    stage = make_stage(broken, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "Hello", "miss")]
    stage.close()
    assert (stage.stats().write_backs, stage.stats().write_failures) == (0, 1)


def test_after_completion_a_new_miss_starts_a_new_flight(cache: TieredCache) -> None:
    engine = FakeEngine()
    stage = make_stage(cache, engine)
    first, second = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", False, first)
    first.wait()
    stage.submit_miss(REQUEST, DIGEST, "miss", False, second)
    assert second.wait() == [("final", "Hello", "miss")]
    assert (engine.calls, stage.stats().coalesced) == (2, 0)
    stage.close()


def all_done(responders: list[Recorder], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    return all(r.done.wait(max(0.0, deadline - time.monotonic())) for r in responders)


def test_single_worker_serves_a_miss(cache: TieredCache) -> None:
    """The waiting reader must not starve its own generation of the only worker."""
    stage = make_stage(cache, FakeEngine(), max_workers=1)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    try:
        assert all_done([r], 2.0), "the miss was never answered: the pool deadlocked"
    finally:
        r.cancelled.set()  # let a stuck reader return so the pool can shut down
        stage.close()


def test_burst_of_misses_while_pool_busy_does_not_deadlock(cache: TieredCache) -> None:
    """Misses queued behind a busy pool take every worker as readers before any of their
    generations is scheduled; they must still be answered."""
    workers = 4
    engine = FakeEngine(gate=threading.Event())
    follows = Follows(workers - 2)
    stage = make_stage(cache, engine, max_workers=workers, on_follow=follows)
    # One generation plus its readers occupy every worker...
    busy = [Recorder() for _ in range(workers - 1)]
    for r in busy:
        stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert follows.reached.wait(TIMEOUT_S)
    # ...while a burst of distinct misses queues up behind them.
    burst = [Recorder() for _ in range(workers)]
    for i, r in enumerate(burst):
        stage.submit_miss(REQUEST, Digest(f"{i:064x}"), "miss", True, r)
    assert engine.gate is not None
    engine.gate.set()
    try:
        assert all_done(busy, TIMEOUT_S)
        assert all_done(burst, 2.0), "queued misses were never answered: the pool deadlocked"
    finally:
        for r in busy + burst:
            r.cancelled.set()
        stage.close()


def test_after_store_runs_once_only_when_the_answer_is_stored(cache: TieredCache) -> None:
    stored_calls: list[str] = []
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r, lambda: stored_calls.append("indexed"))
    assert r.wait() == [("final", "Hello", "miss")]
    stage.close()
    assert stored_calls == ["indexed"]
    not_stored: list[str] = []
    stage = make_stage(TieredCache([(Tier.L1, MemoryStore(1 << 20))]), FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", False, r, lambda: not_stored.append("indexed"))
    assert r.wait() == [("final", "Hello", "miss")]
    stage.close()
    assert not_stored == []


def test_a_followers_index_write_runs_when_its_leader_brought_none(cache: TieredCache) -> None:
    """A semantic hit being verified carries no vector (its prompt is not indexed by it); a
    plain miss for the same prompt that joins its flight does, and its index write runs once
    the answer is stored (before, the leader's None decided for every follower)."""
    engine = FakeEngine(gate=threading.Event())
    follows = Follows(1)
    stage = make_stage(cache, engine, on_follow=follows)
    indexed: list[str] = []
    verifying, plain = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, verifying, None, verify="Hello")
    engine.wait_started()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, plain, lambda: indexed.append("indexed"))
    assert follows.reached.wait(TIMEOUT_S)
    assert engine.gate is not None
    engine.gate.set()
    assert verifying.wait() == [("final", "Hello", "verified")]
    assert plain.wait()[0][:2] == ("final", "Hello")
    stage.close()
    assert indexed == ["indexed"]


def test_failing_after_store_does_not_fail_the_answer(cache: TieredCache) -> None:
    def broken() -> None:
        raise RuntimeError("index unavailable")

    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r, broken)
    assert r.wait() == [("final", "Hello", "miss")]  # the hook runs before the flight completes
    assert stored_text(cache) == "Hello"
    assert stage.stats().write_failures == 1


def test_semantic_hit_carries_its_similarity() -> None:
    r = Recorder()
    Generations.serve_hit("cached", "semantic", r, 0.93)
    assert r.wait() == [("final", "cached", "semantic", 0.93)]


def test_bypass_is_generated_even_when_an_entry_exists(cache: TieredCache) -> None:
    """no-cache (and semantic-only) asked not to be served from the exact cache: the producer
    must not answer them from an entry that is already there."""
    cache.put(DIGEST, "OLD")
    engine = FakeEngine()
    stage = make_stage(cache, engine)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "bypass", True, r)
    assert r.wait() == [("final", "Hello", "bypass")]
    assert engine.calls == 1
    assert stored_text(cache) == "Hello"


def test_bypass_does_not_join_a_looked_up_miss_in_flight(cache: TieredCache) -> None:
    """A miss's leader may answer from an entry stored after its lookup; a no-cache request
    joining its flight would get that instead of a fresh generation: it gets its own flight."""
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine)
    miss, bypass = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, miss)
    engine.wait_started()
    stage.submit_miss(REQUEST, DIGEST, "bypass", True, bypass)
    engine.wait_started()  # a second generation started: the bypass did not follow the miss
    assert engine.gate is not None
    engine.gate.set()
    assert miss.wait() == [("final", "Hello", "miss")]
    assert bypass.wait() == [("final", "Hello", "bypass")]
    assert (engine.calls, stage.stats().coalesced) == (2, 0)
    stage.close()


@pytest.mark.parametrize(
    ("second", "max_age_s", "write_back"),
    [("miss", 30.0, True), ("miss", None, False), ("bypass", None, True)],
)
def test_requests_that_want_other_answers_lead_their_own_flight(
    cache: TieredCache, second: str, max_age_s: float | None, write_back: bool
) -> None:
    engine = FakeEngine(gate=threading.Event())
    follows = Follows(1)
    stage = make_stage(cache, engine, on_follow=follows)
    first, other, same = Recorder(), Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, first)
    engine.wait_started()
    stage.submit_miss(REQUEST, DIGEST, second, write_back, other, max_age_s=max_age_s)
    engine.wait_started()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, same)  # joins the first flight
    assert follows.reached.wait(TIMEOUT_S)  # joined before the gate opens, not after
    assert engine.gate is not None
    engine.gate.set()
    for r, status in ((first, "miss"), (other, second), (same, "miss")):
        assert r.wait() == [("final", "Hello", status)]
    assert (engine.calls, stage.stats().coalesced) == (2, 1)
    stage.close()


def test_failing_generation_report_does_not_fail_the_answer(cache: TieredCache) -> None:
    def report(record: GenerationRecord) -> None:
        raise RuntimeError("metrics backend down")

    stage = make_stage(cache, FakeEngine(), on_generation=report)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "Hello", "miss")]
    assert stored_text(cache) == "Hello"
    stage.close()


class HandOverLeases:
    """A LeaseCoordinator stand-in: the lease is held elsewhere once, then handed over."""

    wait_s = 5.0

    def __init__(self) -> None:
        self.calls = 0
        self.released: list[Lease] = []

    def acquire(self, digest: str) -> tuple[LeaseState, Lease | None]:
        self.calls += 1
        if self.calls == 1:
            return LeaseState.HELD, None
        return LeaseState.ACQUIRED, Lease(f"lease:{digest}", "token")

    def held(self, digest: str) -> bool | None:
        return False  # the other replica let go without an answer

    def pause(self) -> None:
        time.sleep(0.01)

    def release(self, lease: Lease) -> bool:
        self.released.append(lease)
        return True

    def close(self) -> None:
        pass


class OneHolderLeases(HandOverLeases):
    """A LeaseCoordinator stand-in whose first acquire wins and whose lease stays held."""

    wait_s = 60.0

    def acquire(self, digest: str) -> tuple[LeaseState, Lease | None]:
        self.calls += 1
        if self.calls == 1:
            return LeaseState.ACQUIRED, Lease(f"lease:{digest}", "first")
        return LeaseState.HELD, None

    def held(self, digest: str) -> bool | None:
        return True


def test_a_miss_after_an_invalidation_does_not_wait_for_the_killed_generations_lease(
    cache: TieredCache,
) -> None:
    """The generation an invalidation killed still holds its cross-replica lease until it
    ends; the flight that replaces it in this process generates at once instead of waiting
    for that lease (up to lease_wait_s, a minute) for an answer that will not be stored."""
    from tiercache.exact.invalidation import Invalidator

    engine = FakeEngine(gate=threading.Event())
    leases = OneHolderLeases()
    stage = make_stage(cache, engine, leases=leases)
    before, after = Recorder(), Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, before)
    engine.wait_started()
    cache.now = lambda: time.time() + 1.0  # type: ignore[method-assign] # past the skew
    Invalidator(cache).key(DIGEST)
    cache.now = lambda: time.time() + 2.0  # type: ignore[method-assign]
    stage.submit_miss(REQUEST, DIGEST, "miss", True, after)
    engine.wait_started()  # while the first still runs, holding the lease
    assert leases.calls == 2
    assert engine.gate is not None
    engine.gate.set()
    assert after.wait() == [("final", "Hello", "miss")]
    assert before.wait() == [("final", "Hello", "miss")]
    assert stored_text(cache) == "Hello"
    stage.close()
    assert leases.released == [Lease(f"lease:{DIGEST}", "first")]


def test_a_lease_wait_reads_the_tiers_once_a_second_not_every_poll() -> None:
    """While another replica holds the lease, the waiter polls the lease every 50 ms and reads
    the tiers (a value planted under the key is read up to 4 MiB and checked) only every
    LEASE_READ_EVERY polls; the answer stored before the holder let go is found by the read
    after the next acquire."""
    from tiercache.generation import LEASE_READ_EVERY

    class CountingReads(TieredCache):
        reads = 0

        def get(self, key: str, max_age_s: float | None = None, request: bool = True):  # type: ignore[override]
            self.reads += 1
            return super().get(key, max_age_s, request)

    class HeldFor(HandOverLeases):
        polls = 0

        def held(self, digest: str) -> bool | None:
            self.polls += 1
            if self.polls == 2 * LEASE_READ_EVERY:  # the holder stores, then lets go
                cache.put(DIGEST, "the other replica's answer")
            return self.polls < 2 * LEASE_READ_EVERY

        def pause(self) -> None:
            pass

    cache = CountingReads([(Tier.L2, MemoryStore(1 << 20))])
    leases = HeldFor()
    engine = FakeEngine()
    stage = make_stage(cache, engine, leases=leases)  # type: ignore[arg-type]
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "the other replica's answer", "miss")]
    stage.close()
    assert engine.calls == 0
    # the re-check before the lease, two in the wait, the one after the takeover
    assert cache.reads == 4
    assert leases.released == [Lease(f"lease:{DIGEST}", "token")]


def test_lease_taken_over_is_released_when_the_read_after_it_fails() -> None:
    class FailsAfterWaiting(TieredCache):
        reads = 0

        def get(self, key: str, max_age_s: float | None = None, request: bool = True):  # type: ignore[override]
            self.reads += 1
            if self.reads >= 3:  # the recheck, the wait loop, then the read after the takeover
                raise OSError("L2 read failed")
            return super().get(key, max_age_s, request)

    leases = HandOverLeases()
    failing = FailsAfterWaiting([(Tier.L2, MemoryStore(1 << 20))])
    stage = make_stage(failing, FakeEngine(), leases=leases)  # type: ignore[arg-type]
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    calls = r.wait()
    assert calls[0][0] == "error" and "OSError" in str(calls[0][1])  # its text: in the log
    assert leases.released == [Lease(f"lease:{DIGEST}", "token")]
    stage.close()


def test_a_greedy_miss_drafts_from_and_keeps_its_prompts_answer(cache: TieredCache) -> None:
    """The answer kept under the draft digest reaches the engine as its draft; the new answer,
    once stored, is kept there for the next request of the prompt (with the answer's tenant
    and adapter, so their invalidations drop it too); `no-speculate` reads no draft; a sampled
    request reads the draft but its sample is not kept there."""
    seen: list[tuple[tuple[str, str], ...]] = []

    class Drafted(FakeEngine):
        def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
            seen.append(request.drafts)
            return super().__call__(request)

    drafts = Digest("f" * 64)
    tenant, adapter = "s" * 64, "a" * 64
    request = GenerationRequest(prompt="hi", tenant_scope=tenant, lora_digest=adapter)
    cache.put(drafts, "Hello there, a longer answer", tenant_scope=tenant, adapter=adapter)
    stage = make_stage(cache, Drafted())
    first = Recorder()
    stage.submit_miss(request, DIGEST, "miss", True, first, draft_digest=drafts)
    assert first.wait() == [("final", "Hello", "miss")]  # stored (and kept) before it is sent
    assert seen == [(("answer", "Hello there, a longer answer"),)]
    kept = cache.get(drafts)
    assert kept is not None and kept.entry.text == "Hello"
    assert (kept.entry.tenant_scope, kept.entry.adapter) == (tenant, adapter)
    sampled = Recorder()  # drafts from the kept greedy answer; its own sample is not kept
    stage.submit_miss(
        dataclasses.replace(request, temperature=0.9, seed=5), Digest("c" * 64), "miss", True,
        sampled, draft_digest=drafts,
    )  # fmt: skip
    assert sampled.wait() == [("final", "Hello", "miss")]
    assert seen[-1] == (("answer", "Hello"),)
    assert cache.get(Digest("c" * 64)) is not None  # stored under its own digest
    still = cache.get(drafts)
    assert still is not None and still.entry.created_s == kept.entry.created_s
    quiet = Recorder()
    other = Digest("e" * 64)
    stage.submit_miss(
        GenerationRequest(prompt="hi", speculate=False), other, "miss", True, quiet,
        draft_digest=drafts,
    )  # fmt: skip
    quiet.wait()
    assert seen[-1] == ()
    stage.close()


def test_a_miss_drafts_from_its_neighbours_answers_in_its_own_scope_only(
    cache: TieredCache,
) -> None:
    """The answers under the neighbours embedding_cache named go to the engine after the
    prompt's own, each only if it belongs to the request's tenant scope and adapter (a forged
    or damaged index row never carries another tenant's or adapter's text into the engine),
    once per text; a missing one is skipped."""
    seen: list[tuple[tuple[str, str], ...]] = []
    indexed: list[bool] = []

    class Drafted(FakeEngine):
        def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
            seen.append(request.drafts)
            indexed.append(request.index_answer)
            return super().__call__(request)

    tenant, adapter = "s" * 64, "a" * 64
    own, near, same_text, foreign, other_adapter, gone = (Digest(c * 64) for c in "123456")
    cache.put(own, "the prompt's answer", tenant_scope=tenant, adapter=adapter)
    cache.put(near, "a neighbour's answer", tenant_scope=tenant, adapter=adapter)
    cache.put(same_text, "a neighbour's answer", tenant_scope=tenant, adapter=adapter)
    cache.put(foreign, "another tenant's answer", tenant_scope="t" * 64, adapter=adapter)
    cache.put(other_adapter, "another adapter's answer", tenant_scope=tenant, adapter="b" * 64)
    stage = make_stage(cache, Drafted())
    request = GenerationRequest(prompt="hi", tenant_scope=tenant, lora_digest=adapter)
    done = Recorder()
    stage.submit_miss(
        request, DIGEST, "miss", False, done, draft_digest=own,
        neighbours=(foreign, gone, near, other_adapter, same_text),
    )  # fmt: skip
    done.wait()
    assert seen == [(("answer", "the prompt's answer"), ("neighbour", "a neighbour's answer"))]
    assert not indexed[-1]  # not stored (write_back false): not kept as a draft source either
    sampled = Recorder()
    stage.submit_miss(
        dataclasses.replace(request, temperature=0.7, seed=1), Digest("9" * 64), "miss",
        False, sampled, neighbours=(near,),
    )  # fmt: skip
    sampled.wait()
    assert seen[-1] == (("neighbour", "a neighbour's answer"),)  # a sampled miss drafts too
    forged = Recorder()  # drafts never come from the request itself, only from the cache
    stage.submit_miss(
        dataclasses.replace(request, drafts=(("answer", "planted"),)), Digest("8" * 64),
        "miss", True, forged,
    )  # fmt: skip
    forged.wait()
    assert seen[-1] == () and indexed[-1]
    stage.close()


def test_a_semantic_hit_to_verify_is_the_engines_first_draft_and_verified_when_it_is_its_answer(
    cache: TieredCache,
) -> None:
    """`verify`: the semantic hit's answer reaches the engine as its first draft (source
    `verify`, before the prompt's kept answer); the response is `verified` when the engine's
    answer is exactly it, else a miss, stored either way like any miss; `on_verified` says
    which. A request that opted out of speculation gets no draft but is judged the same way."""
    seen: list[tuple[tuple[str, str], ...]] = []

    class Drafted(FakeEngine):
        def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
            seen.append(request.drafts)
            return super().__call__(request)

    tenant = "s" * 64
    kept = Digest("f" * 64)
    cache.put(kept, "Hello there", tenant_scope=tenant)
    stage = make_stage(cache, Drafted())
    request = GenerationRequest(prompt="hi", tenant_scope=tenant)
    outcomes: list[bool] = []
    for digest, candidate, status, draft in (
        (Digest("1" * 64), "Hello", "verified", "Hello there"),
        (Digest("2" * 64), "Hello, and more", "miss", "Hello"),  # the first one's, kept
    ):
        r = Recorder()
        stage.submit_miss(
            request, digest, "miss", True, r, draft_digest=kept, verify=candidate,
            on_verified=outcomes.append,
        )  # fmt: skip
        assert r.wait() == [("final", "Hello", status)]
        assert seen[-1] == (("verify", candidate), ("answer", draft))
        assert stored_text(cache, digest) == "Hello"
    assert outcomes == [True, False]
    quiet = Recorder()
    stage.submit_miss(
        dataclasses.replace(request, speculate=False), Digest("3" * 64), "miss", True, quiet,
        verify="Hello", on_verified=outcomes.append,
    )  # fmt: skip
    assert quiet.wait() == [("final", "Hello", "verified")]
    assert seen[-1] == () and outcomes[-1] is True
    # an answer stored since the lookup is served without the engine: unchecked, as a miss
    cache.put(Digest("4" * 64), "Hello", tenant_scope=tenant)
    stored = Recorder()
    stage.submit_miss(
        request, Digest("4" * 64), "miss", True, stored, verify="Hello",
        on_verified=outcomes.append,
    )  # fmt: skip
    assert stored.wait() == [("final", "Hello", "miss")]
    assert len(seen) == 3 and outcomes[-1] is None
    stage.close()


@pytest.mark.parametrize(
    ("mean_logprob", "ttl_s"),
    [(math.log(0.9), 3600.0), (math.log(0.2), 60.0), (None, 3600.0)],
)
def test_an_answers_confidence_is_stored_and_an_unsure_one_is_kept_shorter(
    mean_logprob: float | None, ttl_s: float
) -> None:
    """The engine's mean log-probability goes into the stored entry; under the confidence
    floor (0.5 here) the answer is stored with unsure_ttl_s, above it or unknown with the
    cache's own TTL."""
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))], default_ttl_s=3600.0)
    engine = FakeEngine(mean_logprob=mean_logprob)
    stage = make_stage(cache, engine, confidence=ConfidencePolicy(0.5, 60.0))
    responder = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, responder)
    assert responder.wait()[-1][:2] == ("final", "Hello")
    found = cache.get(DIGEST)
    stage.close()  # closes the cache too
    assert found is not None
    assert found.entry.mean_logprob == mean_logprob
    assert found.entry.ttl_s == ttl_s


def test_an_answer_is_stored_with_what_generating_it_cost_and_its_temperature() -> None:
    """The engine call's seconds (the record's duration) and the request's temperature go into
    the entry: L1's eviction weighs them (tiercache.exact.stores.answer_group)."""
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))], default_ttl_s=3600.0)
    records: list[GenerationRecord] = []
    stage = make_stage(cache, FakeEngine(), on_generation=records.append)
    sampled = GenerationRequest(prompt="hi", temperature=0.7, seed=3)
    responder = Recorder()
    stage.submit_miss(sampled, DIGEST, "miss", True, responder)
    assert responder.wait()[-1][:2] == ("final", "Hello")
    found = cache.get(DIGEST)
    stage.close()
    assert found is not None and len(records) == 1
    assert found.entry.generation_s == records[0].duration_s > 0.0
    assert found.entry.temperature == pytest.approx(0.7)


@pytest.mark.parametrize(
    ("engine_s", "expected"),
    [
        (0.25, 0.25),
        (None, "duration"),
        (float("nan"), "duration"),
        (-1.0, "duration"),
        (1e9, "duration"),
    ],
)
def test_an_answers_cost_is_the_engines_own_seconds_not_its_queues(
    engine_s: float | None, expected: float | str
) -> None:
    """The engine's ENGINE_S (from when its worker took the request up) is the answer's cost:
    the call's duration counts the wait behind other requests, so a caller flooding the engine
    with distinct prompts made its answers look that much dearer to L1's and L2's eviction.
    Unknown or impossible values fall back to the duration (and never exceed it)."""
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))], default_ttl_s=3600.0)
    records: list[GenerationRecord] = []
    gate = threading.Event()
    engine = FakeEngine(engine_s=engine_s, gate=gate)
    stage = make_stage(cache, engine, on_generation=records.append)
    responder = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, responder)
    engine.wait_started()
    time.sleep(0.3)  # queued behind others: the call's duration grows, the engine's own does not
    gate.set()
    assert responder.wait()[-1][:2] == ("final", "Hello")
    found = cache.get(DIGEST)
    stage.close()
    assert found is not None and len(records) == 1
    assert records[0].duration_s >= 0.3
    want = records[0].duration_s if expected == "duration" else expected
    assert found.entry.generation_s == pytest.approx(want)


def test_an_answer_stored_since_the_lookup_reports_how_it_ended(cache: TieredCache) -> None:
    """Served instead of a generation, a stored answer says what a hit on it would: its finish
    reason (`length` tells a client the answer was cut at max_tokens) and its token counts."""
    cache.put(DIGEST, "from cache", finish_reason="length", generated_tokens=7, prompt_tokens=12)
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "from cache", "miss")]
    assert (r.finish_reason, r.tokens) == ("length", (12, 7))
    stage.close()


@pytest.mark.parametrize(("serve_ttl_s", "served"), [(0.0, "from cache"), (60.0, "from cache"),
                                                     (5.0, "Hello")])  # fmt: skip
def test_the_re_check_serves_no_answer_older_than_prompt_cache_would(
    cache: TieredCache, serve_ttl_s: float, served: str
) -> None:
    """llm's read of the tiers before it generates keeps to prompt_cache's ttl_s (the
    envelope's `serve_ttl_s`) as well as its own: a padded tenant's answers all come through
    it, and llm's ttl_s (0 here: no cap) may be longer than the age prompt_cache serves."""
    cache.put(DIGEST, "from cache", created_s=time.time() - 10.0)
    stage = make_stage(cache, FakeEngine())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r, serve_ttl_s=serve_ttl_s)
    assert r.wait() == [("final", served, "miss")]
    stage.close()


def test_a_producer_that_cannot_start_fails_its_flight_and_frees_it(
    cache: TieredCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread for the generation (the producer pool cannot grow): the leader and its
    followers get an error, and the flight leaves the table (a later request starts afresh)."""
    stage = make_stage(cache, FakeEngine())

    def no_thread(*args: object, **kwargs: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(stage._producers, "submit", no_thread)
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    calls = r.wait()
    assert calls[0][0] == "error" and "could not start" in str(calls[0][1])
    assert stage.flights.in_flight() == 0
    monkeypatch.undo()
    again = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, again)
    assert again.wait() == [("final", "Hello", "miss")]
    stage.close()


def test_a_lease_release_that_fails_still_ends_the_flight(cache: TieredCache) -> None:
    class BrokenRelease:
        wait_s = 1.0

        def acquire(self, digest: str) -> tuple[LeaseState, Lease | None]:
            return LeaseState.ACQUIRED, Lease(digest, "token")

        def release(self, lease: Lease) -> None:
            raise ValueError("a reply Redis should never send")

        def close(self) -> None:
            pass

    stage = make_stage(cache, FakeEngine(), leases=BrokenRelease())
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("final", "Hello", "miss")]
    deadline = time.monotonic() + TIMEOUT_S
    while stage.flights.in_flight():
        assert time.monotonic() < deadline, "the flight never left the table"
        time.sleep(0.01)
    stage.close()


def test_a_request_joining_as_the_last_one_leaves_gets_the_answer(cache: TieredCache) -> None:
    """The only requester cancels and its generation ends abandoned; a new identical request
    that arrives while that generation is still being reported must not join it (it would be
    told "abandoned" with nothing wrong): it starts afresh and gets the answer."""
    gate, reporting, release = threading.Event(), threading.Event(), threading.Event()

    def slow_report(record: GenerationRecord) -> None:
        reporting.set()
        assert release.wait(TIMEOUT_S)

    engine = FakeEngine(gate=gate)
    stage = make_stage(cache, engine, on_generation=slow_report)
    leaving = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, leaving)
    engine.wait_started()
    leaving.cancelled.set()
    assert leaving.wait() == [("cancelled",)]
    gate.set()
    assert reporting.wait(TIMEOUT_S)  # decided abandoned, not yet completed
    joining = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, joining)
    time.sleep(0.1)  # let it join (or lead) before the report ends
    release.set()
    assert joining.wait() == [("final", "Hello", "miss")]
    stage.close()


def test_misses_past_the_pending_bound_are_refused_at_once(cache: TieredCache) -> None:
    """A burst bigger than `max_pending` queues no engine work for the rest: each is refused
    at once with a capacity error; once the queue drains, misses are served again."""
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine, max_pending=3, max_workers=1)
    waiting = [Recorder() for _ in range(3)]
    for i, r in enumerate(waiting):
        stage.submit_miss(GenerationRequest(prompt=f"q{i}"), Digest(f"{i:064x}"), "miss", True, r)
    refused = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, refused)
    calls = refused.wait()
    assert calls[0][0] == "error" and type(calls[0][1]).__name__ == "CapacityError"
    assert stage.pending == (3, 1)
    assert engine.gate is not None
    engine.gate.set()
    for r in waiting:
        assert r.wait()[0][0] == "final"
    later = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, later)
    assert later.wait() == [("final", "Hello", "miss")]
    stage.close()


def test_work_cancelled_requesters_leave_behind_stays_within_the_pending_bound(
    cache: TieredCache,
) -> None:
    """A flight's generation holds its leader's pending slot until it ends: misses whose
    requesters all cancelled while their producers queued behind a busy engine still count,
    so a caller who sends and cancels cannot pile up flights and queued producers; the queued
    ones start no engine call, and their slots come back as each ends."""
    engine = FakeEngine(gate=threading.Event())
    stage = make_stage(cache, engine, max_pending=4, max_workers=2)
    requesters = [Recorder() for _ in range(4)]
    for i, r in enumerate(requesters):
        stage.submit_miss(GenerationRequest(prompt=f"q{i}"), Digest(f"{i:064x}"), "miss", True, r)
    engine.wait_started(2)  # two producers in the engine; the other two requests queue

    def cancel(rs: list[Recorder]) -> None:
        for r in rs:
            r.cancelled.set()
        for r in rs:
            assert r.wait() == [("cancelled",)]

    cancel(requesters[:2])  # their readers go; the queued two lead flights, producers queued
    deadline = time.monotonic() + TIMEOUT_S
    while stage.flights.in_flight() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stage.flights.in_flight() == 4
    cancel(requesters[2:])
    refused = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "miss", True, refused)
    calls = refused.wait()
    assert calls[0][0] == "error" and type(calls[0][1]).__name__ == "CapacityError"
    assert stage.pending == (4, 1)
    assert engine.gate is not None
    engine.gate.set()
    deadline = time.monotonic() + TIMEOUT_S
    while stage.pending[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stage.pending == (0, 1)
    assert engine.calls == 2  # the two queued producers found nobody waiting
    assert stage.flights.in_flight() == 0
    stage.close()


def test_a_miss_cancelled_before_its_turn_starts_no_flight(cache: TieredCache) -> None:
    """A request already cancelled when a worker takes it up is answered cancelled at once:
    it joins no flight and leads none (no producer, no lookup, no lease)."""
    engine = FakeEngine()
    looked_up: list[str] = []
    stage = make_stage(cache, engine)
    stage._stored = lambda *args: looked_up.append("re-check")  # type: ignore[method-assign]
    r = Recorder(cancelled=True)
    stage.submit_miss(REQUEST, DIGEST, "miss", True, r)
    assert r.wait() == [("cancelled",)]
    stage.close()
    assert looked_up == [] and engine.calls == 0
    assert stage.flights.in_flight() == 0 and stage.pending == (0, 0)


class TurnEngine:
    """A GenerateFn holding one of `slots` engine streams per call, as EngineBls does: an empty
    event once the call has its turn, then (`sent`) the call going out."""

    def __init__(self, slots: int) -> None:
        self.streams = threading.BoundedSemaphore(slots)
        self.gate = threading.Event()
        self.sent: list[str] = []
        self.waiting = threading.Event()

    def __call__(self, request: GenerationRequest) -> Iterator[StreamEvent]:
        if not self.streams.acquire(blocking=False):
            self.waiting.set()
            self.streams.acquire()
        try:
            yield StreamEvent("")
            self.sent.append(request.prompt)
            if request.prompt == "first":
                assert self.gate.wait(TIMEOUT_S)
            yield StreamEvent("x", "stop", generated_tokens=1)
        finally:
            self.streams.release()


def test_a_flight_everyone_left_while_it_waited_for_an_engine_stream_sends_no_call(
    cache: TieredCache,
) -> None:
    """The engine call's turn is an event: a flight whose requesters all left while it waited
    for a stream is closed there, before its call goes out."""
    engine = TurnEngine(slots=1)
    stage = make_stage(cache, engine)
    first, second = Recorder(), Recorder()
    stage.submit_miss(GenerationRequest(prompt="first"), DIGEST, "miss", True, first)
    deadline = time.monotonic() + TIMEOUT_S
    while not engine.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    stage.submit_miss(GenerationRequest(prompt="second"), Digest("e" * 64), "miss", True, second)
    assert engine.waiting.wait(TIMEOUT_S)
    second.cancelled.set()
    assert second.wait() == [("cancelled",)]
    engine.gate.set()
    assert first.wait() == [("final", "x", "miss")]
    stage.close()
    assert engine.sent == ["first"]
    assert stored_text(cache, "e" * 64) is None


def test_an_empty_answer_to_verify_is_verified_and_reported(cache: TieredCache) -> None:
    """A semantic hit whose cached answer is empty is still one to verify: the engine's own
    empty answer makes it `verified`, and the outcome is reported once."""
    outcomes: list[bool | None] = []
    stage = make_stage(cache, FakeEngine(chunks=()))
    r = Recorder()
    stage.submit_miss(REQUEST, DIGEST, "semantic", True, r, verify="", on_verified=outcomes.append)
    assert r.wait() == [("final", "", "verified")]
    assert outcomes == [True]
    stage.close()
