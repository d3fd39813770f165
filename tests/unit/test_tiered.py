"""The read-through tiered cache (tiercache.exact.tiered) with an injected clock."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from tiercache.errors import Unavailable
from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import Reach, TieredCache, TierSlot
from tiercache.vocabulary import Tier


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def l1() -> MemoryStore:
    return MemoryStore(1 << 20)


@pytest.fixture
def l2(tmp_path: Path) -> Iterator[LmdbStore]:
    store = LmdbStore(tmp_path / "l2", 1 << 20)
    yield store
    store.close()


def test_l2_hit_is_promoted_into_l1(l1: MemoryStore, l2: LmdbStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock)
    l2.put("k", CacheEntry("answer", created_s=clock.now))
    assert l1.get("k") is None
    first = cache.get("k")
    assert first is not None and (first.tier, first.entry.text) == (Tier.L2, "answer")
    second = cache.get("k")
    assert second is not None and (second.tier, second.entry.text) == (Tier.L1, "answer")
    assert l2.stats().hits == 1  # the second read never reached L2


def test_put_writes_both_tiers(l1: MemoryStore, l2: LmdbStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock, default_ttl_s=5.0)
    written = cache.put("k", "answer", finish_reason="length", generated_tokens=3)
    assert written == CacheEntry("answer", clock.now, 5.0, "length", 3)
    assert l1.get("k") == written
    assert l2.get("k") == written


def test_miss_in_both_tiers(l1: MemoryStore, l2: LmdbStore) -> None:
    assert TieredCache([(Tier.L1, l1), (Tier.L2, l2)]).get("k") is None


@pytest.mark.parametrize("promoted", [False, True])
def test_ttl_expiry(l1: MemoryStore, l2: LmdbStore, clock: FakeClock, promoted: bool) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock, default_ttl_s=10.0)
    if promoted:
        cache.put("k", "answer")
    else:
        l2.put("k", CacheEntry("answer", created_s=clock.now, ttl_s=10.0))
    created = clock.now
    clock.now = created + 9.999
    live = cache.get("k")
    assert live is not None and live.entry.text == "answer"
    clock.now = created + 10.0
    assert cache.get("k") is None
    assert l1.stats().entries == 0
    assert l2.stats().entries == 0
    clock.now = created  # deleted, not just hidden
    assert cache.get("k") is None


def test_explicit_ttl_overrides_default(l1: MemoryStore, l2: LmdbStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock, default_ttl_s=10.0)
    cache.put("k", "answer", ttl_s=1.0)
    clock.now += 1.0
    assert cache.get("k") is None


def test_ttl_zero_never_expires(l1: MemoryStore, l2: LmdbStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock, default_ttl_s=0.0)
    cache.put("k", "answer")
    clock.now += 1e9
    found = cache.get("k")
    assert found is not None and found.entry.text == "answer"


def test_without_l1(l2: LmdbStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L2, l2)], clock=clock)
    cache.put("k", "answer")
    for _ in range(2):
        found = cache.get("k")
        assert found is not None and (found.tier, found.entry.text) == (Tier.L2, "answer")
    assert [t for t, _ in cache.stores()] == [Tier.L2]
    assert cache.delete("k") is True
    assert cache.delete("k") is False
    assert cache.get("k") is None


def test_without_l2(l1: MemoryStore, clock: FakeClock) -> None:
    cache = TieredCache([(Tier.L1, l1)], clock=clock)
    cache.put("k", "answer")
    found = cache.get("k")
    assert found is not None and found.tier == Tier.L1
    assert cache.delete("k") is True
    assert cache.get("k") is None


def test_delete_removes_from_both_tiers(l1: MemoryStore, l2: LmdbStore) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)])
    cache.put("k", "answer")
    assert cache.delete("k") is True
    assert l1.get("k") is None and l2.get("k") is None


class Broken(MemoryStore):
    """A tier whose reads, writes and deletes fail (a disk error, Redis gone mid-call)."""

    def get(self, key: str) -> CacheEntry | None:
        raise OSError("read failed")

    def peek(self, key: str) -> CacheEntry | None:
        raise OSError("read failed")

    def put(self, key: str, entry: CacheEntry) -> None:
        raise OSError("disk full")

    def delete(self, key: str) -> bool:
        raise OSError("delete failed")


def test_a_tier_that_fails_to_read_is_a_miss_there(l2: LmdbStore, clock: FakeClock) -> None:
    TieredCache([(Tier.L2, l2)], clock=clock).put("k", "from L2")
    cache = TieredCache([(Tier.L1, Broken(1 << 20)), (Tier.L2, l2)], clock=clock)
    found = cache.get("k")
    assert found is not None and (found.entry.text, found.tier) == ("from L2", Tier.L2)
    assert TieredCache([(Tier.L1, Broken(1 << 20))], clock=clock).get("k") is None


def test_a_failing_tier_does_not_keep_the_answer_from_the_others(
    l1: MemoryStore, clock: FakeClock
) -> None:
    l3 = MemoryStore(1 << 20)
    tiers = [(Tier.L1, l1), (Tier.L2, Broken(1 << 20)), (Tier.L3, l3)]
    cache = TieredCache(tiers, clock=clock)
    with pytest.raises(OSError, match="disk full"):
        cache.put("k", "answer")
    assert l3.get("k") is not None and l1.get("k") is not None


def test_readers_ttl_caps_what_it_serves_whatever_the_writer_gave(
    l2: LmdbStore, clock: FakeClock
) -> None:
    """prompt_cache reads what llm wrote: its own ttl_s must still bound the age it serves."""
    TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=0).put("k", "forever")  # the writer
    reader_tiers = [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, l2)]
    reader = TieredCache(reader_tiers, clock=clock, default_ttl_s=60)
    assert reader.get("k") is not None
    clock.now += 61
    assert reader.get("k") is None
    without = TieredCache([(Tier.L2, l2)], clock=clock)
    assert without.get("k") is not None  # kept for a reader without a ttl_s of its own


def test_an_answer_an_invalidation_already_covers_is_not_written(
    l1: MemoryStore, l2: LmdbStore, clock: FakeClock
) -> None:
    """A generation that started before a watermark this process knows: readers would refuse
    it, and once the watermark is forgotten (past max_events) it would be served again."""
    from tiercache.exact.watermarks import Invalidation
    from tiercache.vocabulary import InvalidationKind

    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock)
    started_s = clock.now
    clock.now += 10
    cache.invalidations.note(Invalidation(InvalidationKind.TAG, "kb", clock.now - 5))
    assert cache.put("k", "stale", tags=("kb",), created_s=started_s) is None
    assert l1.get("k") is None and l2.get("k") is None
    assert cache.put("k", "fresh", tags=("kb",)) is not None
    assert l2.get("k") is not None


def test_a_side_record_merged_from_an_older_one_is_back_dated_towards_it(
    l2: LmdbStore, clock: FakeClock
) -> None:
    """A side record merged over one a tier holds is back-dated towards it, at most
    SIDE_LAG_S: a tenant invalidation issued in between, and heard here only after the merge,
    covers what it carries (stamped "now", it did not). Never further: a floor raised again
    and again lives ttl_s after its last raise, and one merged under a lowered ttl_s is not
    written already expired."""
    from tiercache.exact.tiered import SIDE_LAG_S
    from tiercache.exact.watermarks import Invalidation
    from tiercache.semantic.side_entries import read_sides
    from tiercache.vocabulary import InvalidationKind

    cache = TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=100.0)
    first_s = clock.now
    assert cache.merge_side("side", lambda held: (held or "") + "a", "scope-a") == 1
    clock.now += 30
    issued_s = clock.now  # another replica invalidates the tenant; heard here later
    clock.now += 10
    assert cache.merge_side("side", lambda held: (held or "") + "b", "scope-a") == 1
    held = l2.get("side")
    lag = min(SIDE_LAG_S, 100.0 / 4)  # a quarter of ttl_s, when that is less
    assert held is not None and held.text == "ab" and held.created_s == clock.now - lag
    assert first_s < held.created_s <= issued_s
    assert read_sides(cache, "side", "scope-a")[0] == ["ab"]
    cache.invalidations.note(Invalidation(InvalidationKind.TENANT, "scope-a", issued_s))
    assert read_sides(cache, "side", "scope-a")[0] == []  # what it carried went with the tenant
    clock.now += 1
    assert cache.merge_side("side", lambda held: (held or "") + "c", "scope-a") == 1
    held = l2.get("side")
    assert held is not None and held.created_s == clock.now and held.ttl_s == 100.0
    stamped = held.created_s
    for _ in range(6):  # raised every 50 s, far past its first making's ttl_s
        clock.now += 50
        assert cache.merge_side("side", lambda held: (held or "") + "+", "scope-a") == 1
        held = l2.get("side")
        stamped = max(stamped, clock.now - lag)
        assert held is not None and held.created_s == stamped
    assert read_sides(cache, "side", "scope-a")[0] == ["c++++++"]
    clock.now += 100.0  # expired: the next merge starts afresh
    assert read_sides(cache, "side", "scope-a")[0] == []
    assert cache.merge_side("side", lambda held: (held or "") + "e", "scope-a") == 1
    assert read_sides(cache, "side", "scope-a")[0] == ["e"]
    # without a default TTL the merged record never expires, as before
    forever = TieredCache([(Tier.L2, l2)], clock=clock)
    clock.now += 5
    assert forever.merge_side("side", lambda held: (held or "") + "d", "scope-a") == 1
    held = l2.get("side")
    assert held is not None and held.text == "ed" and held.ttl_s == 0.0
    clock.now += 1000  # ttl_s lowered to 30 s: a record back-dated 60 s would be expired
    short = TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=30.0)
    assert short.merge_side("side", lambda held: (held or "") + "f", "scope-a") == 1
    assert read_sides(short, "side", "scope-a")[0] == ["edf"]


def test_exists_raises_on_a_broken_tier_and_fills_nothing(
    l1: MemoryStore, clock: FakeClock
) -> None:
    """Compaction deletes the rows of answers that are gone: a read error must not count as
    gone (get() takes it for a miss)."""
    l2 = MemoryStore(1 << 20)
    TieredCache([(Tier.L2, l2)], clock=clock).put("k", "answer", ttl_s=60)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=clock)
    assert cache.exists("k") and l1.get("k") is None  # found, not copied into L1
    clock.now += 61
    assert not cache.exists("k")  # expired
    with pytest.raises(OSError, match="read failed"):
        TieredCache([(Tier.L1, Broken(1 << 20)), (Tier.L2, l2)], clock=clock).exists("k")


def test_exists_takes_an_unreadable_l2_for_an_error_and_counts_no_read(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L2's `get` takes a damaged page or a map another process resized for a miss: `exists`
    (what compaction deletes rows by) took such an L2 for "the answer is gone". And reads
    that are not requests (`exists`, a draft's `get(request=False)`) counted as requests in
    L2's hits and eviction values."""
    l2 = LmdbStore(tmp_path / "l2", 1 << 22)
    cache = TieredCache([(Tier.L2, l2)], clock=clock)
    cache.put("k", "answer")
    hits = l2.stats().hits
    assert cache.exists("k") and cache.get("k", request=False) is not None
    assert l2.stats().hits == hits

    def resized(*args: object, **kwargs: object) -> None:
        raise lmdb.MapResizedError("another process grew the map")

    monkeypatch.setattr(l2, "_env", type("Env", (), {"begin": staticmethod(resized)})())
    with pytest.raises(Unavailable, match="could not be read"):
        cache.exists("k")


class Logged(MemoryStore):
    """A tier that notes each write in a log shared with the other tiers."""

    def __init__(self, name: str, log: list[str]) -> None:
        super().__init__(1 << 20)
        self.name, self.log = name, log

    def put(self, key: str, entry: CacheEntry) -> None:
        self.log.append(self.name)
        super().put(key, entry)


def test_writes_go_to_shared_tiers_first_then_this_processs() -> None:
    """L2 first (the host's other processes see it), then L3 (other replicas), then L1."""
    log: list[str] = []
    l1, l2, l3 = Logged("l1", log), Logged("l2", log), Logged("l3", log)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2), (Tier.L3, l3)])
    cache.put("k", "answer")
    assert log == ["l2", "l3", "l1"]
    assert cache.stores() == [(Tier.L1, l1), (Tier.L2, l2), (Tier.L3, l3)]  # nearest first
    assert cache.local_stores() == [(Tier.L1, l1), (Tier.L2, l2)]
    assert [slot.reach for slot in cache.tiers] == [Reach.PROCESS, Reach.HOST, Reach.FLEET]


def test_the_write_order_follows_each_tiers_reach_not_its_name() -> None:
    log: list[str] = []
    near, far = Logged("near", log), Logged("far", log)
    cache = TieredCache([TierSlot(Tier.L1, near, Reach.HOST), TierSlot(Tier.L2, far, Reach.FLEET)])
    cache.put("k", "answer")
    assert log == ["near", "far"]
    assert cache.local_stores() == [(Tier.L1, near)]


def test_store_finds_a_tier_by_name_and_a_tier_named_twice_is_refused(
    l1: MemoryStore, l2: LmdbStore
) -> None:
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)])
    assert cache.store(Tier.L1) is l1 and cache.store(Tier.L2) is l2
    assert cache.store(Tier.L3) is None
    with pytest.raises(ValueError, match="named twice"):
        TieredCache([(Tier.L1, l1), (Tier.L1, MemoryStore(1 << 20))])


def test_a_table_forgetting_sooner_than_the_cache_serves_is_refused(
    l2: LmdbStore, clock: FakeClock
) -> None:
    """The table may forget a watermark only once every entry it covers is too old to serve:
    its horizon must not be shorter than the cache's ttl_s, nor set when answers never expire."""
    from tiercache.exact.watermarks import InvalidationTable

    for ttl_s in (0.0, 120.0):
        with pytest.raises(ValueError, match="served again"):
            TieredCache(
                [(Tier.L2, l2)], default_ttl_s=ttl_s, invalidations=InvalidationTable(horizon_s=60)
            )
    TieredCache([(Tier.L2, l2)], default_ttl_s=60, invalidations=InvalidationTable(horizon_s=60))
    TieredCache([(Tier.L2, l2)], default_ttl_s=30, invalidations=InvalidationTable(horizon_s=60))
    own = TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=60).invalidations
    assert own.horizon_s == 60 and TieredCache([(Tier.L2, l2)]).invalidations.horizon_s is None


def test_exists_refuses_what_is_too_old_for_this_reader(l2: LmdbStore, clock: FakeClock) -> None:
    """As get() does: an entry written without a TTL is not usable past the reader's ttl_s."""
    TieredCache([(Tier.L2, l2)], clock=clock).put("k", "forever")
    reader = TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=60)
    assert reader.exists("k")
    clock.now += 60
    assert not reader.exists("k") and reader.get("k") is None
    assert TieredCache([(Tier.L2, l2)], clock=clock).exists("k")


class Raced(LmdbStore):
    """L2 where another process writes `fresh` right after this process read the key (between
    its read and its drop of what it read)."""

    fresh: CacheEntry | None = None

    def get(self, key: str) -> CacheEntry | None:
        found = super().get(key)
        if self.fresh is not None:
            self.put(key, self.fresh)
            self.fresh = None
        return found


def test_an_expired_entry_is_dropped_but_not_an_answer_written_after_the_read(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A read finds the entry expired and drops it: an answer another process stored between
    that read and the drop stays (and is the next read's hit); one still expired goes."""
    l2 = Raced(tmp_path / "l2", 1 << 20)
    cache = TieredCache([(Tier.L2, l2)], clock=clock)
    cache.put("k", "old", ttl_s=10)
    clock.now += 11
    l2.fresh = CacheEntry(text="new", created_s=clock.now)
    assert cache.get("k") is None  # the old one, expired
    found = cache.get("k")
    assert found is not None and found.entry.text == "new"
    cache.put("j", "old", ttl_s=10)
    clock.now += 11
    assert cache.get("j") is None and l2.peek("j") is None  # dropped: nothing replaced it
    l2.close()
