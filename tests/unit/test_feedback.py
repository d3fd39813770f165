"""tiercache.feedback: bad feedback invalidates the answer's entry once, good raises its rank, and
an id is taken only from the tenant it was served to (real L1 and L2, no Redis)."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest
import redis
from redis_server import RedisServer
from test_invalidation import FakeClock

from tiercache.errors import Forbidden, InvalidRequest, Unavailable
from tiercache.eviction import GreedyDualFrequencyPolicy, named_policy
from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.codec import MAX_ENDORSEMENTS, CacheEntry
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.l2_values import MIN_MAP_BYTES, L2Values
from tiercache.exact.redis_tier import RedisLink, RedisStore
from tiercache.exact.stores import LmdbStore, MemoryStore, Store
from tiercache.exact.tiered import ENDORSEMENT_RECHECK_S, TieredCache
from tiercache.feedback import Feedback, Verdict, parse_verdict
from tiercache.vocabulary import InvalidationKind, Tier

SECRET = bytes(range(32))
SCOPE = "scope-a"
DIGEST = hashlib.sha256(b"an answer").hexdigest()
KEPT = hashlib.sha256(b"a neighbour's answer").hexdigest()

GDSF_ENTRY_BYTES = (
    GreedyDualFrequencyPolicy.entry_overhead_bytes
)  # what L1 adds per entry under gdsf


@pytest.fixture(params=["l2-values", "no-values"])
def setup(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[Feedback, TieredCache, FakeClock, AnswerIds]]:
    """L2 with its shared values (what the stages open) and without (an `oldest` L2)."""
    clock = FakeClock()
    values = None
    if request.param == "l2-values":
        values = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, clock=clock)
    l2 = LmdbStore(tmp_path / "l2", 1 << 20, values=values)
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, l2)], clock=clock)
    ids = AnswerIds(SECRET)
    yield Feedback(ids, Invalidator(cache)), cache, clock, ids
    cache.close()


def beside(
    l2: Store, clock: FakeClock, ticks: list[float], l1: MemoryStore | None = None
) -> TieredCache:
    """Another process's tiers over the same L2: its own L1 (1 MiB unless given), a check of
    its copies every 5 s on the clock `ticks[0]`."""
    return TieredCache(
        [(Tier.L1, l1 if l1 is not None else MemoryStore(1 << 20)), (Tier.L2, l2)],
        clock=clock,
        endorsement_check_s=5.0,
        monotonic=lambda: ticks[0],
    )


def served(ids: AnswerIds, clock: FakeClock, digest: str = DIGEST, scope: str = SCOPE) -> str:
    return ids.issue(AnswerRef(digest, ServedAs.OWN, issued_s=clock.now), scope)


def test_bad_invalidates_the_entry_and_nothing_else(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "a wrong answer", tenant_scope=SCOPE)
    cache.put(KEPT, "a right answer", tenant_scope=SCOPE)
    clock.now += 1.0
    report = feedback.give(served(ids, clock), Verdict.BAD, SCOPE)
    assert (report.invalidated, report.published, report.served) == (True, False, ServedAs.OWN)
    assert cache.get(DIGEST) is None
    kept = cache.get(KEPT)
    assert kept is not None and kept.entry.text == "a right answer"


def test_a_replayed_bad_invalidates_nothing_more_but_a_later_answer_is_invalidated_again(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "first answer", tenant_scope=SCOPE)
    clock.now += 1.0
    first_id = served(ids, clock)
    clock.now += 1.0
    assert feedback.give(first_id, Verdict.BAD, SCOPE).invalidated
    clock.now += 1.0
    cache.put(DIGEST, "generated again", tenant_scope=SCOPE)  # the next request's
    replay = feedback.give(first_id, Verdict.BAD, SCOPE)
    assert not replay.invalidated
    found = cache.get(DIGEST)
    assert found is not None and found.entry.text == "generated again"
    clock.now += 1.0
    assert feedback.give(served(ids, clock), Verdict.BAD, SCOPE).invalidated
    assert cache.get(DIGEST) is None
    # A tenant-wide invalidation after an answer was served covers it as well.
    cache.put(DIGEST, "third answer", tenant_scope=SCOPE)
    clock.now += 1.0
    answered = served(ids, clock)
    clock.now += 1.0
    Invalidator(cache).tenant(SCOPE)
    assert not feedback.give(answered, Verdict.BAD, SCOPE).invalidated


def test_a_watermark_within_the_skew_of_the_answer_does_not_count_as_covering_it(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """`issued_s` is the serving host's clock: an invalidation that is not clearly later than
    the answer (within the skew allowance) may have come before it, so bad invalidates again
    (an answer held that is not clearly newer than the id may be the one served)."""
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "an answer", tenant_scope=SCOPE)
    answered = served(ids, clock)
    Invalidator(cache).key(DIGEST)  # the same instant, by another hand
    assert feedback.give(answered, Verdict.BAD, SCOPE).invalidated


@pytest.mark.parametrize("verdict", [Verdict.BAD, Verdict.GOOD])
@pytest.mark.parametrize("gone", ["tag", "evicted"])
def test_a_verdict_with_an_old_id_does_not_act_on_a_newer_answer(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds], verdict: Verdict, gone: str
) -> None:
    """The answer an id names was invalidated by its tag (which the id does not carry) or
    evicted (which leaves no watermark), and generated again: a verdict with the old id
    invalidated (or endorsed) the new answer, fleet-wide. An answer made clearly after the id
    was issued is not the one the verdict is about."""
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "first answer", tenant_scope=SCOPE, tags=("faq",))
    clock.now += 1.0
    old_id = ids.issue(AnswerRef(DIGEST, ServedAs.CACHED, issued_s=clock.now), SCOPE)  # a hit
    clock.now += 1.0
    if gone == "tag":
        Invalidator(cache).tag("faq")
    else:
        for _, store in cache.stores():
            store.delete(DIGEST)
    clock.now += 1.0
    cache.put(DIGEST, "generated again", tenant_scope=SCOPE, tags=("faq",))
    report = feedback.give(old_id, verdict, SCOPE)
    assert not report.invalidated and not report.endorsed
    found = cache.get(DIGEST)
    assert found is not None and found.entry.text == "generated again"
    assert found.entry.endorsements == 0


def test_an_id_that_names_another_tenants_entry_is_refused(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """Defence in depth: were an id ever forged, the entry's own tenant is checked too."""
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "b's answer", tenant_scope="scope-b")
    with pytest.raises(Forbidden, match="another tenant"):
        feedback.give(served(ids, clock), Verdict.BAD, SCOPE)
    assert cache.get(DIGEST) is not None


def test_good_keeps_the_entry_and_raises_its_endorsements_in_the_shared_tier_up_to_the_most(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "a good answer", tenant_scope=SCOPE, generation_s=4.0)
    semantic = ids.issue(AnswerRef(DIGEST, ServedAs.SEMANTIC, 0.91, clock.now), SCOPE)
    report = feedback.give(semantic, Verdict.GOOD, SCOPE)
    assert (report.invalidated, report.served, report.endorsed) == (False, ServedAs.SEMANTIC, True)
    assert report.to_json(masked=True) == {"verdict": "good", "accepted": True}
    l2 = cache.store(Tier.L2)
    assert l2 is not None
    stored = l2.get(DIGEST)
    assert stored is not None
    assert (stored.text, stored.endorsements, stored.generation_s) == ("a good answer", 1, 4.0)
    for count in range(2, MAX_ENDORSEMENTS + 1):
        assert feedback.give(served(ids, clock), Verdict.GOOD, SCOPE).endorsed
        stored = l2.get(DIGEST)
        assert stored is not None and stored.endorsements == count
    at_most = feedback.give(served(ids, clock), Verdict.GOOD, SCOPE)
    assert not at_most.endorsed and at_most.to_json()["reaches"] == "counted"
    stored = l2.get(DIGEST)
    assert stored is not None and stored.endorsements == MAX_ENDORSEMENTS


def test_good_on_an_answer_no_longer_cached_endorses_nothing(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "an answer", tenant_scope=SCOPE)
    answered = served(ids, clock)
    clock.now += 1.0
    Invalidator(cache).key(DIGEST)
    report = feedback.give(answered, Verdict.GOOD, SCOPE)
    assert not report.endorsed and cache.get(DIGEST) is None


def test_an_endorsed_answer_outranks_an_equal_one_in_the_next_l1_that_admits_it(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """Another process's L1, filled from L2 after the verdict: the endorsed answer counts as
    asked for once more, so the unendorsed one of the same size and cost goes first."""
    feedback, cache, clock, ids = setup
    for digest in (DIGEST, KEPT):
        cache.put(digest, "same size", tenant_scope=SCOPE, generation_s=1.0)
    assert feedback.give(served(ids, clock, KEPT), Verdict.GOOD, SCOPE).endorsed
    l2 = cache.store(Tier.L2)
    assert l2 is not None
    size = CacheEntry("same size", 0.0, tenant_scope=SCOPE).size_bytes + GDSF_ENTRY_BYTES
    other = TieredCache(
        [(Tier.L1, MemoryStore(2 * size + 8, named_policy("gdsf"))), (Tier.L2, l2)], clock=clock
    )
    for digest in (KEPT, DIGEST):  # the endorsed one admitted first: recency alone drops it
        assert other.get(digest) is not None
    l1 = other.store(Tier.L1)
    assert l1 is not None
    l1.put("newcomer", CacheEntry("same size", clock.now, tenant_scope=SCOPE, generation_s=1.0))
    assert l1.get(KEPT) is not None
    assert l1.get(DIGEST) is None


def test_an_l1_that_already_holds_the_answer_takes_up_good_verdicts_on_a_later_hit(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """Another process's L1 holding both answers before the verdict: a hit after
    `endorsement_check_s` queues a comparison of its copy with L2's (the first hit only starts
    the clock), made on a background thread, which counts the new verdict, so the endorsed
    answer outlives the other; the verdict is counted once however many hits follow."""
    feedback, cache, clock, ids = setup
    for digest in (DIGEST, KEPT):
        cache.put(digest, "same size", tenant_scope=SCOPE, generation_s=1.0)
    l2 = cache.store(Tier.L2)
    assert l2 is not None
    size = CacheEntry("same size", 0.0, tenant_scope=SCOPE).size_bytes + GDSF_ENTRY_BYTES
    ticks = [0.0]
    other = beside(l2, clock, ticks, MemoryStore(2 * size + 8, named_policy("gdsf")))
    for digest in (KEPT, DIGEST):  # both held; the one to be endorsed admitted first
        assert other.get(digest) is not None
    for digest in (KEPT, DIGEST):
        assert other.get(digest) is not None  # first L1 hits: the clocks start
    assert feedback.give(served(ids, clock, KEPT), Verdict.GOOD, SCOPE).endorsed
    ticks[0] = 1.0
    assert other.get(KEPT) is not None
    assert other.wait_endorsements() and other.endorsements_caught == 0  # not yet
    ticks[0] = 6.0
    for _ in range(3):
        hit = other.get(KEPT)
        assert hit is not None and hit.tier is Tier.L1
    assert other.wait_endorsements() and other.endorsements_caught == 1  # off the hit's thread
    l1 = other.store(Tier.L1)
    assert isinstance(l1, MemoryStore)
    held = l1.peek(KEPT)
    assert held is not None and held.endorsements == 1
    for _ in range(4):  # as many hits for the other: only the verdict sets them apart
        assert other.get(DIGEST) is not None
    l1.put("newcomer", CacheEntry("same size", clock.now, tenant_scope=SCOPE, generation_s=1.0))
    assert l1.peek(KEPT) is not None
    assert l1.peek(DIGEST) is None


def test_an_l1_copy_replaced_in_the_shared_tiers_is_dropped_at_a_later_hit(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """Another process replaced the answer in L2 (a warm, a `no-cache` request): this
    process's L1 copy, with no TTL, was served for good. The comparison a hit past
    `endorsement_check_s` queues drops it when every shared tier holds a newer answer; the
    next request reads the new one."""
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "the old answer", tenant_scope=SCOPE)
    l2 = cache.store(Tier.L2)
    assert l2 is not None
    ticks = [0.0]
    other = beside(l2, clock, ticks)
    assert other.get(DIGEST) is not None  # into this process's L1
    assert other.get(DIGEST) is not None  # its first L1 hit: the clock starts
    clock.now += 10.0
    cache.put(DIGEST, "the new answer", tenant_scope=SCOPE)  # replaced, elsewhere
    ticks[0] = 6.0
    hit = other.get(DIGEST)
    assert hit is not None and hit.entry.text == "the old answer"  # still, this once
    assert other.wait_endorsements() and other.l1_replaced == 1
    found = other.get(DIGEST)
    assert found is not None and found.entry.text == "the new answer"


def test_a_check_that_finds_l2_unwritten_since_the_last_comparison_skips_it(
    tmp_path: Path,
) -> None:
    """Without Redis, whatever a comparison could find (a verdict, a replaced answer) was
    written to this host's L2, which moves its change token (LMDB's last transaction id, by
    whichever process wrote): a check finding the token as it was before the key's last
    comparison queues none. A write to L2 (any key) makes the next check compare; so does
    `ENDORSEMENT_RECHECK_S` after the last comparison, whatever the token says."""
    clock = FakeClock()
    writer = TieredCache([(Tier.L2, LmdbStore(tmp_path / "l2", 1 << 20))], clock=clock)
    writer.put(DIGEST, "an answer", tenant_scope=SCOPE)
    l2 = writer.store(Tier.L2)
    assert isinstance(l2, LmdbStore)
    token = l2.change_token()
    assert token is not None
    ticks = [0.0]
    reader = beside(l2, clock, ticks)

    def compared_after_hit_at(tick: float) -> bool:
        ticks[0] = tick
        before = reader.endorsements_compared
        hit = reader.get(DIGEST)
        assert hit is not None and hit.tier is Tier.L1
        assert reader.wait_endorsements()
        return reader.endorsements_compared == before + 1

    assert reader.get(DIGEST) is not None  # into L1
    assert reader.get(DIGEST) is not None  # the first L1 hit: the clock starts
    assert not compared_after_hit_at(3.0)  # within endorsement_check_s
    assert compared_after_hit_at(6.0)  # the first check compares: no token was kept before it
    assert not compared_after_hit_at(12.0)  # nothing written since
    assert not compared_after_hit_at(18.0)
    assert reader.endorsement_checks_skipped == 2
    assert l2.change_token() == token  # reads and hits write nothing
    writer.put(KEPT, "another answer", tenant_scope=SCOPE)  # another key
    assert l2.change_token() != token
    assert compared_after_hit_at(24.0)
    assert not compared_after_hit_at(30.0)
    assert compared_after_hit_at(24.0 + ENDORSEMENT_RECHECK_S)  # the bound, unwritten or not
    # a verdict given since (feedback writes the endorsed entry) is taken up at the next check
    ids = AnswerIds(SECRET)
    assert Feedback(ids, Invalidator(writer)).give(served(ids, clock), Verdict.GOOD, SCOPE).endorsed
    assert compared_after_hit_at(30.0 + ENDORSEMENT_RECHECK_S)
    assert reader.endorsements_caught == 1
    # a replaced answer is found at the check after the write, as without the token
    clock.now += 10.0
    writer.put(DIGEST, "the new answer", tenant_scope=SCOPE)
    assert compared_after_hit_at(36.0 + ENDORSEMENT_RECHECK_S)
    assert reader.l1_replaced == 1
    found = reader.get(DIGEST)
    assert found is not None and found.entry.text == "the new answer"
    reader.close()
    writer.close()


def test_a_comparison_that_could_not_read_l2_keeps_no_token(tmp_path: Path) -> None:
    """A shared tier that fails to read leaves the comparison incomplete: the next check
    compares again instead of skipping. L2 fails as a damaged map does (LMDB raises
    CorruptedError when a read transaction opens), which `peek` takes for a missing answer:
    the comparison's read says it failed."""
    clock = FakeClock()
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    ticks = [0.0]
    reader = beside(l2, clock, ticks)
    reader.put(DIGEST, "an answer", tenant_scope=SCOPE)
    assert reader.get(DIGEST) is not None  # the first L1 hit: the clock starts
    env = l2._env
    broken = [True]

    class Damaged:
        def begin(self, *args: object, **kwargs: object) -> object:
            if broken[0]:
                raise lmdb.CorruptedError("a damaged page")
            return env.begin(*args, **kwargs)

        def __getattr__(self, name: str) -> object:
            return getattr(env, name)

    l2._env = Damaged()
    assert l2.peek(DIGEST) is None  # what `peek` makes of it
    for tick in (6.0, 12.0):  # each check compares: the failed one kept no token
        ticks[0] = tick
        assert reader.get(DIGEST) is not None and reader.wait_endorsements()
    assert (reader.endorsements_compared, reader.endorsement_checks_skipped) == (0, 0)
    broken[0] = False
    for tick in (18.0, 24.0):  # read: compared once, then skipped
        ticks[0] = tick
        assert reader.get(DIGEST) is not None and reader.wait_endorsements()
    assert (reader.endorsements_compared, reader.endorsement_checks_skipped) == (1, 1)
    l2._env = env
    reader.close()


def test_the_token_kept_is_the_one_the_comparisons_read_saw(tmp_path: Path) -> None:
    """A commit shows in L2's meta page (`change_token`) while its metadata is synced, before
    a new read transaction sees it. A check that read the token in that window, and whose
    comparison then read the snapshot before the commit, must keep the snapshot's token:
    keeping the one read first would skip every later check, and the write (here an answer
    replaced on another process) would go unseen until `ENDORSEMENT_RECHECK_S`."""
    clock = FakeClock()
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    real_token = l2.change_token
    ahead = [False]

    def token_in_the_window() -> int | None:
        token = real_token()
        return None if token is None else token + (1 if ahead[0] else 0)

    l2.change_token = token_in_the_window  # type: ignore[method-assign]
    ticks = [0.0]
    reader = beside(l2, clock, ticks)
    reader.put(DIGEST, "the old answer", tenant_scope=SCOPE)
    assert reader.get(DIGEST) is not None  # the first L1 hit: the clock starts
    ticks[0] = 6.0
    ahead[0] = True  # the next commit shows in the meta page; the comparison reads before it
    assert reader.get(DIGEST) is not None and reader.wait_endorsements()
    assert reader.endorsements_compared == 1
    ahead[0] = False
    writer = TieredCache([(Tier.L2, l2)], clock=clock)
    clock.now += 10.0
    writer.put(DIGEST, "the new answer", tenant_scope=SCOPE)  # that commit, now seen by reads
    ticks[0] = 12.0
    assert reader.get(DIGEST) is not None and reader.wait_endorsements()
    assert (reader.endorsements_compared, reader.endorsement_checks_skipped) == (2, 0)
    assert reader.l1_replaced == 1
    found = reader.get(DIGEST)
    assert found is not None and found.entry.text == "the new answer"
    reader.close()


@pytest.mark.parametrize("b_has_l1", [True, False], ids=["l1-hits", "no-l1"])
def test_a_verdict_given_on_another_host_reaches_this_hosts_l2_through_redis(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str, b_has_l1: bool
) -> None:
    """Two hosts share Redis (L3), each with its own L2 (with its values) and, unless a stage
    of host B keeps none, its own L1. A `good` verdict given on host A (its feedback writes A's
    tiers and L3) reaches host B's L2 copy at B's next hit past the check interval (an L1 hit,
    or an L2 hit where there is no L1): written back with the verdict in one transaction and
    counted in B's L2 values, so B's L2 eviction ranks it as endorsed; once, however many
    hits follow."""
    clock = FakeClock()

    def host(name: str, ticks: list[float], l1: bool = True) -> TieredCache:
        link = RedisLink.from_url(redis_server.url, redis_prefix, secret=b"f" * 32)  # one fleet
        values = L2Values(tmp_path / name / "l2-values", MIN_MAP_BYTES)
        l2 = LmdbStore(tmp_path / name / "l2", 1 << 20, values=values)
        return TieredCache(
            [
                *([(Tier.L1, MemoryStore(1 << 20))] if l1 else []),
                (Tier.L2, l2),
                (Tier.L3, RedisStore(link, clock=clock, stats_max_age_s=0)),
            ],
            clock=clock,
            endorsement_check_s=5.0,
            monotonic=lambda: ticks[0],
        )

    ticks_a, ticks_b = [0.0], [0.0]
    a, b = host("a", ticks_a), host("b", ticks_b, l1=b_has_l1)
    a.put(DIGEST, "an answer", tenant_scope=SCOPE, generation_s=1.0)
    assert b.get(DIGEST) is not None  # B's L2 (and L1) take their copies from L3
    assert b.get(DIGEST) is not None  # a first hit from B's own tiers: the clock starts
    b_l2 = b.store(Tier.L2)
    assert isinstance(b_l2, LmdbStore)
    value_before = b_l2.value(DIGEST)
    assert value_before is not None
    ids = AnswerIds(SECRET)
    report = Feedback(ids, Invalidator(a)).give(served(ids, clock), Verdict.GOOD, SCOPE)
    assert report.endorsed
    held = b_l2.peek(DIGEST)
    assert held is not None and held.endorsements == 0  # B's L2 is behind
    ticks_b[0] = 6.0
    for _ in range(3):
        assert b.get(DIGEST) is not None
    assert b.wait_endorsements()
    held = b_l2.peek(DIGEST)
    assert held is not None and held.endorsements == 1 and held.text == "an answer"
    assert b.l2_endorsements_caught == 1 and b.endorsements_caught == int(b_has_l1)
    value_after = b_l2.value(DIGEST)
    assert value_after is not None and value_after > value_before
    ticks_b[0] = 12.0
    assert b.get(DIGEST) is not None and b.wait_endorsements()
    assert b.l2_endorsements_caught == 1  # counted once
    # another answer under the key (regenerated) is never overwritten by the older copy's count
    assert b_l2.endorse(DIGEST, held.created_s - 1.0, 2) == 0
    # a count past what an entry may carry is capped (the entry stays readable)
    assert b_l2.endorse(DIGEST, held.created_s, 9) == MAX_ENDORSEMENTS - 1
    capped = b_l2.peek(DIGEST)
    assert capped is not None and capped.endorsements == MAX_ENDORSEMENTS
    a.close()
    b.close()


def test_good_never_writes_the_served_answer_over_a_newer_one(
    tmp_path: Path, redis_server: RedisServer, redis_prefix: str
) -> None:
    """Host A's L2 still holds the answer that was served; host B generated it again (a
    `no-cache` request: no watermark) into its L2 and L3. A `good` verdict given on A endorses
    A's copy and leaves L3's newer answer alone (it wrote A's old copy to every tier,
    reverting the fleet's answer until its TTL)."""
    clock = FakeClock()

    def host(name: str) -> TieredCache:
        link = RedisLink.from_url(redis_server.url, redis_prefix, secret=b"f" * 32)
        return TieredCache(
            [
                (Tier.L2, LmdbStore(tmp_path / name / "l2", 1 << 20)),
                (Tier.L3, RedisStore(link, clock=clock, stats_max_age_s=0)),
            ],
            clock=clock,
        )

    a, b = host("a"), host("b")
    a.put(DIGEST, "the old answer", tenant_scope=SCOPE)
    ids = AnswerIds(SECRET)
    served_id = served(ids, clock)  # the old answer, served from A
    clock.now += 10.0
    b.put(DIGEST, "the new answer", tenant_scope=SCOPE)  # L3 now holds B's
    report = Feedback(ids, Invalidator(a)).give(served_id, Verdict.GOOD, SCOPE)
    assert report.endorsed  # A's own copy took it
    l2_a, l3 = a.store(Tier.L2), a.store(Tier.L3)
    assert l2_a is not None and l3 is not None
    mine = l2_a.peek(DIGEST)
    assert mine is not None and (mine.text, mine.endorsements) == ("the old answer", 1)
    shared = l3.get(DIGEST)
    assert shared is not None and (shared.text, shared.endorsements) == ("the new answer", 0)
    a.close()
    b.close()


def test_another_tenants_feedback_is_refused_and_changes_nothing(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "an answer", tenant_scope=SCOPE)
    with pytest.raises(Forbidden):
        feedback.give(served(ids, clock), Verdict.BAD, "scope-b")
    with pytest.raises(InvalidRequest):
        feedback.give("a1.garbage", Verdict.BAD, SCOPE)
    assert cache.get(DIGEST) is not None


@pytest.mark.parametrize(("text", "verdict"), [("bad", Verdict.BAD), (" Good ", Verdict.GOOD)])
def test_verdicts_parse(text: str, verdict: Verdict) -> None:
    assert parse_verdict(text) is verdict


@pytest.mark.parametrize("text", ["", None, "meh", "0"])
def test_an_unknown_verdict_is_an_invalid_request(text: str | None) -> None:
    with pytest.raises(InvalidRequest, match="verdict must be one of"):
        parse_verdict(text)


def test_an_old_good_does_not_endorse_the_answer_generated_since(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """A `good` on an id issued before the entry was generated again (after a bad verdict)
    is about the old answer: the new one is not endorsed."""
    feedback, cache, clock, ids = setup
    cache.put(DIGEST, "first", tenant_scope=SCOPE)
    first_id = served(ids, clock)
    clock.now += 1.0
    assert feedback.give(served(ids, clock), Verdict.BAD, SCOPE).invalidated
    clock.now += 1.0
    cache.put(DIGEST, "generated again", tenant_scope=SCOPE)
    assert not feedback.give(first_id, Verdict.GOOD, SCOPE).endorsed
    l2 = cache.store(Tier.L2)
    assert l2 is not None
    stored = l2.get(DIGEST)
    assert stored is not None and stored.endorsements == 0
    assert feedback.give(served(ids, clock), Verdict.GOOD, SCOPE).endorsed  # its own id does


def test_the_highest_count_of_the_shared_tiers_goes_on(tmp_path: Path) -> None:
    """Another replica counted two verdicts in L3 that this host's L2 copy has not seen: the
    next one makes three in both, not one."""
    clock = FakeClock()
    l2, l3 = LmdbStore(tmp_path / "l2", 1 << 20), LmdbStore(tmp_path / "l3", 1 << 20)
    cache = TieredCache([(Tier.L2, l2), (Tier.L3, l3)], clock=clock)
    answer = CacheEntry("an answer", clock.now, tenant_scope=SCOPE)
    l2.put(DIGEST, answer)
    l3.put(DIGEST, dataclasses.replace(answer, endorsements=2))
    ids = AnswerIds(SECRET)
    assert Feedback(ids, Invalidator(cache)).give(served(ids, clock), Verdict.GOOD, SCOPE).endorsed
    for store in (l2, l3):
        stored = store.get(DIGEST)
        assert stored is not None and stored.endorsements == 3
    cache.close()


def test_good_endorses_a_miss_whose_id_was_issued_before_its_generation_started(
    setup: tuple[Feedback, TieredCache, FakeClock, AnswerIds],
) -> None:
    """A miss's id is issued as llm takes the request; the entry's created_s is when the
    engine started, after a queue or a lease wait: no invalidation between them, so the verdict
    is about this answer."""
    feedback, cache, clock, ids = setup
    answer_id = served(ids, clock)
    clock.now += 5.0  # waited in the engine's queue
    cache.put(DIGEST, "the answer", tenant_scope=SCOPE)
    assert feedback.give(answer_id, Verdict.GOOD, SCOPE).endorsed


def test_a_bad_verdict_sent_again_after_redis_came_back_reaches_the_other_replicas(
    tmp_path: Path, redis_factory: Callable[[], RedisServer], redis_prefix: str
) -> None:
    """Redis down: the bad verdict's invalidation is applied here and the caller is told to
    send it again. Sent again once Redis is back, the local watermark covered the answer and
    nothing was ever published: every other replica kept serving it. It is published now,
    and the trust outcome of the first try is not counted twice."""
    server = redis_factory()
    clock = FakeClock()
    link = RedisLink.from_url(server.url, redis_prefix, secret=b"f" * 32)
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    cache = TieredCache(
        [(Tier.L2, l2), (Tier.L3, RedisStore(link, clock=clock, stats_max_age_s=0))],
        clock=clock,
    )
    ids = AnswerIds(SECRET)
    feedback = Feedback(ids, Invalidator(cache, link))
    cache.put(DIGEST, "a wrong answer", tenant_scope=SCOPE)
    answer_id = served(ids, clock)
    clock.now += 1
    server.kill()
    with pytest.raises(Unavailable):
        feedback.give(answer_id, Verdict.BAD, SCOPE)
    assert cache.peek(DIGEST) is None  # applied here
    assert feedback.invalidator.unpublished(InvalidationKind.KEY, DIGEST)
    server.start()
    clock.now += 1
    raw = redis.Redis.from_url(server.url)
    heard = raw.pubsub()
    heard.subscribe(redis_prefix + "invalidations")
    assert heard.get_message(timeout=5)["type"] == "subscribe"
    report, deadline = None, time.monotonic() + 30
    while report is None:  # the link's breaker tries Redis again after its retry interval
        assert time.monotonic() < deadline, "Redis never answered again"
        report = _given(feedback, answer_id)
        if report is None:
            time.sleep(0.2)
    assert report.invalidated and report.published
    assert not feedback.invalidator.unpublished(InvalidationKind.KEY, DIGEST)
    message = heard.get_message(timeout=5)
    assert message is not None and DIGEST.encode() in message["data"]
    assert raw.zcard(redis_prefix + "invalidated") == 1  # recorded for replicas that reconnect
    heard.close()
    raw.close()
    cache.close()


def _given(feedback: Feedback, answer_id: str) -> Any:
    """The report of a bad verdict, or None while Redis still refuses it (a retry)."""
    try:
        return feedback.give(answer_id, Verdict.BAD, SCOPE)
    except Unavailable:
        return None
