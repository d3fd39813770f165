"""Invalidation watermarks, sweeps and the three-tier read path without Redis
(tiercache.exact.watermarks, tiercache.exact.invalidation, tiercache.exact.tiered); with Redis:
tests/integration/test_invalidation_redis.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tiercache.errors import Unavailable
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import Invalidator, sweep
from tiercache.exact.stores import LmdbStore, MemoryStore, Store
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import HostWatermarks, Invalidation, InvalidationTable, applies
from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.row_log import scope_tag
from tiercache.semantic.store import SemanticStore
from tiercache.vocabulary import InvalidationKind, Tier

K, T, S, A = (
    InvalidationKind.KEY,
    InvalidationKind.TAG,
    InvalidationKind.TENANT,
    InvalidationKind.ADAPTER,
)


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def entry(created_s: float = 100.0, **meta: object) -> CacheEntry:
    return CacheEntry("answer", created_s, **meta)  # type: ignore[arg-type]


TAGGED = entry(tags=("kb:v1", "faq"), tenant_scope="tenant-a", adapter="ad-1")


@pytest.mark.parametrize(
    ("inv", "key", "expected"),
    [
        (Invalidation(K, "k", 100.0), "k", True),
        (Invalidation(K, "k", 100.0), "other", False),
        (Invalidation(T, "kb:v1", 100.0), "k", True),
        (Invalidation(T, "kb:v2", 100.0), "k", False),
        (Invalidation(S, "tenant-a", 100.0), "k", True),
        (Invalidation(S, "tenant-b", 100.0), "k", False),
        (Invalidation(A, "ad-1", 100.0), "k", True),
        (Invalidation(A, "ad-2", 100.0), "k", False),
        # generated after the invalidation (beyond the skew allowance): a new answer, kept
        (Invalidation(T, "kb:v1", 99.0), "k", False),
        (Invalidation(T, "kb:v1", 99.96), "k", True),  # within skew_s (0.05)
    ],
)
def test_applies(inv: Invalidation, key: str, expected: bool) -> None:
    assert applies(inv, key, TAGGED) is expected


def test_empty_metadata_never_matches_tenant_or_adapter() -> None:
    bare = entry()
    assert not applies(Invalidation(S, "", 1e9), "k", bare)
    assert not applies(Invalidation(A, "", 1e9), "k", bare)
    table = InvalidationTable()
    table.note(Invalidation(T, "faq", 1e9))
    assert not table.covers("k", bare)


def test_table_covers_like_applies_and_keeps_the_newest_watermark() -> None:
    table = InvalidationTable(skew_s=0.0)
    assert not table.covers("k", TAGGED)
    assert table.note(Invalidation(T, "faq", 100.0)) is True
    assert table.covers("k", TAGGED)
    assert not table.covers("k", entry(created_s=100.5, tags=("faq",)))
    assert table.note(Invalidation(T, "faq", 50.0)) is False  # older: not news
    assert table.covers("k", TAGGED) and len(table) == 1
    assert table.note(Invalidation(T, "faq", 200.0)) is True
    assert table.covers("k", entry(created_s=150.0, tags=("faq",)))
    for kind, value in ((K, "k2"), (S, "tenant-a"), (A, "ad-1")):
        fresh = InvalidationTable(skew_s=0.0)
        fresh.note(Invalidation(kind, value, 100.0))
        assert fresh.covers("k2", TAGGED)
        assert not fresh.covers(
            "k2", entry(created_s=101.0, tenant_scope="tenant-a", adapter="ad-1")
        )


def test_a_watermark_younger_than_the_horizon_is_never_forgotten_whatever_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(1_000.0)
    table = InvalidationTable(max_events=10, horizon_s=1_000.0, clock=clock)  # skew_s 0.05
    for i in range(1_000):  # all within the horizon: none may go
        table.note(Invalidation(K, f"k{i}", 900.0 + i / 100))
    assert len(table) == 1_000 and table.forgotten == 0
    assert all(table.covers(f"k{i}", entry(created_s=899.0)) for i in range(1_000))
    assert table.kept_past_max == 990  # every note that left it over max_events
    warnings = [r for r in caplog.records if "more than max_events" in r.getMessage()]
    assert len(warnings) == 1  # at most once a minute, on the table's clock
    assert "ttl_s 1000 s" in warnings[0].getMessage()
    clock.now += 61  # still within the horizon
    table.note(Invalidation(T, "late", clock.now))
    assert len([r for r in caplog.records if "more than max_events" in r.getMessage()]) == 2


def test_past_max_events_only_what_the_horizon_and_skew_passed_is_forgotten() -> None:
    clock = FakeClock(1_000.0)
    table = InvalidationTable(max_events=2, horizon_s=100.0, clock=clock)
    cutoff = 1_000.0 - 100.0 - 2 * table.skew_s  # 899.9: the skew counts for two clocks
    table.note(Invalidation(K, "old", cutoff - 0.01))
    table.note(Invalidation(K, "edge", cutoff + 0.01))
    assert len(table) == 2  # not past max_events: nothing is forgotten, however old
    table.note(Invalidation(T, "new", 999.0))
    assert len(table) == 2 and table.forgotten == 1
    assert not table.covers("old", entry(created_s=0.0))
    assert table.covers("edge", entry(created_s=0.0))  # younger than horizon + allowance
    clock.now += 1.0  # now "edge" is old enough too, and goes at the next note past the bound
    table.note(Invalidation(T, "newer", 999.5))
    assert not table.covers("edge", entry(created_s=0.0)) and len(table) == 2


def test_a_superseded_note_does_not_forget_the_newer_watermark() -> None:
    clock = FakeClock(1_000.0)
    table = InvalidationTable(max_events=1, horizon_s=100.0, clock=clock)
    table.note(Invalidation(T, "kb", 500.0))  # old ...
    table.note(Invalidation(T, "kb", 950.0))  # ... raised again since
    table.note(Invalidation(K, "k", 960.0))
    assert table.covers("x", entry(created_s=950.0, tags=("kb",))) and len(table) == 2
    for i in range(5_000):  # the same watermark raised over and over: the heap stays small
        table.note(Invalidation(K, "k", 960.0 + i / 1_000))
    assert len(table) == 2 and len(table._order) <= 2 * len(table) + 1_024


def test_without_a_horizon_nothing_is_ever_forgotten() -> None:
    clock = FakeClock(1e9)  # every watermark below is ancient
    table = InvalidationTable(max_events=10, clock=clock)
    for i in range(100):
        table.note(Invalidation(K, f"k{i}", float(i)))
    assert len(table) == 100 and table.forgotten == 0 and table.kept_past_max == 90
    assert table.covers("k0", entry(created_s=0.0))


def test_what_the_horizon_forgets_is_never_served_again(tmp_path: Path) -> None:
    """The point of the rule: a reader whose ttl_s is the horizon refuses by age every entry a
    forgotten watermark covered, even with its clock `skew_s` behind the one that forgot."""
    clock = FakeClock(1_000.0)
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    forgetting = TieredCache([(Tier.L2, l2)], clock=clock, default_ttl_s=100.0)
    table = forgetting.invalidations
    table.max_events = 0  # forget at every note
    assert table.horizon_s == 100.0  # the cache's own table takes its horizon
    behind = FakeClock(1_000.0 - table.skew_s)
    reader = TieredCache([(Tier.L2, l2)], clock=behind, default_ttl_s=100.0)
    at_s = 1_000.0 - 100.0 - 2 * table.skew_s - 1e-6  # just past the cutoff
    # the youngest entry it covers, written without a TTL of its own (as an llm with ttl_s 0)
    l2.put("k", CacheEntry("stale", at_s + table.skew_s))
    table.note(Invalidation(K, "k", at_s))
    assert len(table) == 0 and table.forgotten == 1
    assert forgetting.get("k") is None and reader.get("k") is None
    assert not reader.exists("k")
    forgetting.close()


def test_invalidation_json_and_member_round_trip() -> None:
    inv = Invalidation(T, "kb:v1", 123.5, "origin")
    assert Invalidation.from_json(inv.to_json()) == inv
    assert Invalidation.from_member(inv.member().encode(), 123.5) == Invalidation(T, "kb:v1", 123.5)


@pytest.fixture(params=["memory", "lmdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store = MemoryStore(1 << 20) if request.param == "memory" else LmdbStore(tmp_path, 1 << 20)
    yield s
    s.close()


def test_sweep_by_tag_tenant_adapter_and_key(store: Store) -> None:
    store.put("a", entry(tags=("kb:v1",), tenant_scope="t1"))
    store.put("b", entry(tags=("kb:v1", "x"), tenant_scope="t2", adapter="ad"))
    store.put("c", entry(tags=("kb:v2",), tenant_scope="t1"))
    store.put("late", entry(created_s=500.0, tags=("kb:v1",)))
    assert sorted(sweep(store, Invalidation(T, "kb:v1", 200.0))) == ["a", "b"]
    assert sweep(store, Invalidation(A, "ad", 200.0)) == []
    assert sweep(store, Invalidation(S, "t1", 200.0)) == ["c"]
    # A key's entry written clearly after the invalidation is another answer (generated again
    # since; a replayed message must not delete it): kept, as reads keep serving it.
    assert sweep(store, Invalidation(K, "late", 0.0)) == []
    assert store.get("late") is not None
    assert sweep(store, Invalidation(K, "late", 500.0)) == ["late"]
    assert sweep(store, Invalidation(K, "absent", 500.0)) == []
    assert list(store.scan()) == []


# ---------------------------------------------------------------- the tiered read path


@pytest.fixture
def three(tmp_path: Path) -> Iterator[tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore]]:
    l1, l2, l3 = MemoryStore(1 << 20), LmdbStore(tmp_path / "l2", 1 << 20), MemoryStore(1 << 20)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2), (Tier.L3, l3)], clock=FakeClock())
    yield cache, l1, l2, l3
    cache.close()


def test_l3_hit_fills_l2_and_l1(
    three: tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore],
) -> None:
    cache, l1, l2, l3 = three
    l3.put("k", entry(created_s=999.0))
    found = cache.get("k")
    assert found is not None and found.tier is Tier.L3
    assert l2.get("k") == l1.get("k") == entry(created_s=999.0)
    again = cache.get("k")
    assert again is not None and again.tier is Tier.L1


def test_put_writes_every_tier_with_metadata(
    three: tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore],
) -> None:
    cache, l1, l2, l3 = three
    written = cache.put(
        "k", "answer", tags=("kb:v1",), tenant_scope="t", adapter="a", created_s=990.0
    )
    assert written == CacheEntry("answer", 990.0, tags=("kb:v1",), tenant_scope="t", adapter="a")
    assert l1.get("k") == l2.get("k") == l3.get("k") == written


def test_invalidated_entry_is_a_miss_and_dropped_in_every_tier(
    three: tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore],
) -> None:
    cache, l1, l2, l3 = three
    cache.put("k", "old", tags=("kb:v1",), created_s=990.0)
    cache.invalidations.note(Invalidation(T, "kb:v1", 995.0))
    assert cache.get("k") is None
    assert l1.get("k") is None and l2.get("k") is None and l3.get("k") is None
    cache.put("k", "new", tags=("kb:v1",), created_s=996.0)  # generated after: served
    found = cache.get("k")
    assert found is not None and found.entry.text == "new"


def test_max_age_skips_old_entries_for_that_request_only(
    three: tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore],
) -> None:
    cache, l1, l2, l3 = three
    l1.put("k", entry(created_s=900.0))  # 100 s old
    l3.put("k", entry(created_s=995.0))  # 5 s old, from another replica
    assert cache.get("k", max_age_s=1.0) is None
    fresher = cache.get("k", max_age_s=10.0)
    assert fresher is not None and fresher.tier is Tier.L3
    assert fresher.entry.created_s == 995.0
    found = cache.get("k")  # without max-age the promoted fresher entry now sits in L1
    assert found is not None and found.tier is Tier.L1 and found.entry.created_s == 995.0
    assert cache.get("k", max_age_s=0.0) is None
    assert l1.get("k") is not None  # still there for everyone else


def test_local_invalidator_without_redis(
    three: tuple[TieredCache, MemoryStore, LmdbStore, MemoryStore],
) -> None:
    cache, l1, l2, l3 = three
    cache.put("a", "x", tags=("kb:v1",), created_s=990.0)
    cache.put("b", "y", tags=("kb:v2",), created_s=990.0)
    report = Invalidator(cache).tag("kb:v1")
    assert (report.dropped_local, report.dropped_shared, report.published) == (2, 0, False)
    assert report.invalidation.at_s == 1_000.0  # the cache's clock
    assert l3.get("a") is not None  # L3 is swept only through Redis ...
    assert cache.get("a") is None and cache.get("b") is not None  # ... but never served
    assert l3.get("a") is None  # and dropped where it was found
    with pytest.raises(ValueError):
        Invalidator(cache).tag("")


# ---------------------------------------------------------------- semantic rows


def unit(*values: float) -> np.ndarray:
    v = np.zeros(8, dtype=np.float32)
    v[: len(values)] = values
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("flat_max_rows", [10_000, 2])
def test_forgotten_rows_are_never_returned_and_come_back_when_indexed_again(
    tmp_path: Path, flat_max_rows: int
) -> None:
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), 8, flat_max_rows, persist_graphs=False)
    index.add("s", "d1", "p1", unit(1, 0))
    index.add("s", "d2", "p2", unit(1, 0.2))
    index.add("s", "d3", "p3", unit(0, 1))
    assert [n.digest for n in index.search("s", unit(1, 0), k=2)] == ["d1", "d2"]
    assert index.forget(["d1", "unknown"]) == 1
    assert [n.digest for n in index.search("s", unit(1, 0), k=2)] == ["d2", "d3"]
    assert index.size("s") == 2 and index.stats().rows == 2
    index.add("s", "d1", "p1 again", unit(1, 0))  # the answer was generated and indexed anew
    assert [n.prompt for n in index.search("s", unit(1, 0), k=1)] == ["p1 again"]
    index.close()


def test_forgetting_more_digests_than_a_scope_has_rows_finds_them_by_its_keys(
    tmp_path: Path,
) -> None:
    """A scope smaller than the list is read key by key (RowLog.present_digests): rows and
    earlier forgotten lists found the same as by lookups, in every process."""
    store = SemanticStore(tmp_path / "sem")
    first = SemanticIndex(store, 8, 10_000, persist_graphs=False)
    other = SemanticIndex(store, 8, 10_000, persist_graphs=False)  # another process's index
    for i in range(3):
        first.add("s", f"d{i}", f"p{i}", unit(1, i / 10))
        first.add("t", f"d{i}", f"p{i}", unit(i / 10, 1))
    for index in (first, other):
        assert index.search("s", unit(1, 0), k=1) and index.search("t", unit(0, 1), k=1)
    many = ["d1", *(f"unknown{i}" for i in range(50))]
    assert first.forget(many) == 2  # d1's row in both scopes
    assert store.present_digests({scope_tag("s"): 3}, many) == {scope_tag("s"): ["d1"]}
    assert other.forget(many) == 2  # found on the forgotten lists the first one wrote
    for index in (first, other):
        assert "d1" not in [n.digest for n in index.search("s", unit(1, 0.1), k=3)]
        assert index.size("s") == 2 and index.size("t") == 2
    first.close()


def test_searches_go_on_while_a_large_invalidation_is_forgotten(tmp_path: Path) -> None:
    """The log is read and written outside the index's lock: a search during `forget` answers
    at once (it waited for the whole of it: 7.75 s for 5,000 digests over 2,000 scopes)."""
    import threading

    index = SemanticIndex(SemanticStore(tmp_path / "sem"), 8, 10_000, persist_graphs=False)
    index.add("s", "d1", "p1", unit(1, 0))
    index.add("s", "d2", "p2", unit(0, 1))
    assert index.search("s", unit(1, 0), k=1)
    inside, release = threading.Event(), threading.Event()
    forget_digests = index.store.forget_digests

    def slow(tag: str, digests: list[str]) -> list[int]:
        inside.set()
        assert release.wait(30)
        return forget_digests(tag, digests)

    index.store.forget_digests = slow  # type: ignore[method-assign]
    counted: list[int] = []
    worker = threading.Thread(target=lambda: counted.append(index.forget(["d1"])))
    worker.start()
    try:
        assert inside.wait(30)
        searched: list[list[str]] = []
        searcher = threading.Thread(
            target=lambda: searched.append([n.digest for n in index.search("s", unit(1, 0))])
        )
        searcher.start()
        searcher.join(10)
        assert searched == [["d1", "d2"]]  # answered while the log was being written
    finally:
        release.set()
        worker.join(30)
    assert counted == [1]
    assert [n.digest for n in index.search("s", unit(1, 0), k=2)] == ["d2"]
    index.close()


def test_a_failed_fill_does_not_fail_the_hit() -> None:
    class FullStore(MemoryStore):
        def put(self, key: str, entry: CacheEntry) -> None:
            raise OSError("disk full")

    l3 = MemoryStore(1 << 20)
    tiers = [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, FullStore(1 << 20)), (Tier.L3, l3)]
    cache = TieredCache(tiers, clock=FakeClock())
    l3.put("k", entry(created_s=999.0))
    found = cache.get("k")
    assert found is not None and found.tier is Tier.L3
    again = cache.get("k")
    assert again is not None and again.tier is Tier.L1  # the fill above the failing tier held


@pytest.mark.parametrize("flat_max_rows", [10_000, 100])
def test_many_hidden_rows_do_not_inflate_every_search(
    tmp_path: Path, flat_max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hiding 10,000 of 20,000 rows made each search fetch k + 10,000 candidates (0.47 ms to
    19.76 ms per search); the over-fetch is bounded now, and hidden rows are still never
    returned."""
    from tiercache.semantic import index as index_module
    from tiercache.semantic.scope_search import ScopeSearch

    rng = np.random.default_rng(7)
    index = SemanticIndex(SemanticStore(tmp_path / "sem"), 8, flat_max_rows, persist_graphs=False)
    vectors = rng.normal(size=(600, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for i, v in enumerate(vectors):
        index.add("s", f"d{i}", f"p{i}", v)
    assert index.search("s", vectors[0], k=1)  # this process opens the scope
    hidden = [f"d{i}" for i in range(0, 600, 2)]
    assert index.forget(hidden) == 300
    asked: list[int] = []
    search = ScopeSearch.search

    def recording(self: Any, rows: np.ndarray, query: np.ndarray, k: int) -> Any:
        asked.append(k)
        return search(self, rows, query, k)

    monkeypatch.setattr(ScopeSearch, "search", recording)
    for query in vectors[:50]:
        found = index.search("s", query, k=5)
        assert found and not {n.digest for n in found} & set(hidden)
    assert max(asked) == 5 + index_module._DEAD_OVERFETCH
    index.close()


def test_host_watermarks_note_each_record_once(tmp_path: Path) -> None:
    marks = HostWatermarks(tmp_path / "inv", max_events=3)
    table = InvalidationTable()
    assert marks.catch_up(table) == 0
    marks.record(Invalidation(InvalidationKind.TAG, "a", 10.0))
    marks.record(Invalidation(InvalidationKind.KEY, "k", 11.0))
    assert marks.catch_up(table) == 2 and marks.catch_up(table) == 0
    assert table.covers("k", entry(created_s=11.0))
    assert table.covers("x", entry(created_s=5.0, tags=("a",)))
    marks.close()


def test_host_watermarks_keep_what_the_horizon_has_not_passed(tmp_path: Path) -> None:
    clock = FakeClock(1_000.0)
    marks = HostWatermarks(tmp_path / "inv", max_events=3, horizon_s=100.0, clock=clock)
    for i in range(3):  # older than the horizon, but within max_events: kept
        marks.record(Invalidation(T, f"old{i}", 100.0 + i))
    for i in range(5):  # past max_events: the old ones go, oldest first, the young stay
        marks.record(Invalidation(T, f"young{i}", 950.0 + i))
    table = InvalidationTable()
    assert marks.catch_up(table) == 5  # a process starting now reads the young five
    assert marks.forgotten == 3 and marks.kept_past_max == 2
    assert all(table.covers("x", entry(created_s=900.0, tags=(f"young{i}",))) for i in range(5))
    assert not table.covers("x", entry(created_s=0.0, tags=("old0",)))
    marks.close()


def test_host_watermarks_without_a_horizon_keep_every_record(tmp_path: Path) -> None:
    marks = HostWatermarks(tmp_path / "inv", max_events=3, clock=FakeClock(1e9))
    for i in range(10):
        marks.record(Invalidation(T, f"t{i}", float(i)))
    table = InvalidationTable()
    assert marks.catch_up(table) == 10 and marks.forgotten == 0 and marks.kept_past_max == 7
    reopened = HostWatermarks(tmp_path / "inv2", max_events=3)
    assert reopened.swept_until_s() is None
    reopened.mark_swept(5.0)
    reopened.mark_swept(4.0)  # never moves back
    assert reopened.swept_until_s() == 5.0
    reopened.close()
    marks.close()


def test_a_malformed_host_record_is_skipped_not_the_end_of_reading(tmp_path: Path) -> None:
    """A record that is JSON of another shape (a null at_s, a list) is skipped: the records
    after it are still noted, and again on the next read."""
    marks = HostWatermarks(tmp_path / "inv")
    marks.record(Invalidation(T, "first", 10.0))
    with marks._env.begin(write=True) as txn:  # written past the API, as a damaged file might
        raw = txn.get(marks._SEQ)
        seq = int.from_bytes(raw, "big")
        for i, bad in enumerate((b'{"kind": "tag", "value": "x", "at_s": null}', b"[1, 2]")):
            txn.put(marks._key(seq + 1 + i), bad)
        txn.put(marks._SEQ, (seq + 2).to_bytes(8, "big"))
    marks.record(Invalidation(T, "after", 20.0))
    table = InvalidationTable()
    assert marks.catch_up(table) == 2
    assert table.covers("k", entry(created_s=15.0, tags=("after",)))
    marks.record(Invalidation(T, "later", 30.0))
    assert marks.catch_up(table) == 1
    marks.close()


def test_an_invalidation_the_host_log_cannot_record_is_reported(tmp_path: Path) -> None:
    """Without Redis the host's log is how the host's other processes learn of an invalidation:
    when it cannot record one (full), the caller is told, not only the log."""
    marks = HostWatermarks(tmp_path / "inv", map_bytes=64 << 10)
    l1, l2 = MemoryStore(1 << 20), LmdbStore(tmp_path / "l2", 1 << 20)
    cache = TieredCache([(Tier.L1, l1), (Tier.L2, l2)], clock=FakeClock(), host_marks=marks)
    invalidator = Invalidator(cache)
    with pytest.raises(Unavailable, match="could not record"):
        for i in range(10_000):
            invalidator.key(f"{i:064x}")
    key = "f" * 64  # as long as the ones that filled the log
    cache.put(key, "x", created_s=990.0)
    with pytest.raises(Unavailable, match="applied in this process"):
        invalidator.key(key)
    assert cache.get(key) is None  # applied here all the same
    cache.close()
    marks.close()


def test_endorsement_checks_from_many_threads_never_fail_a_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hits on several threads note when each key's copy was last compared; a prune of that
    memo while other threads add to it must not raise into a hit."""
    import threading

    from tiercache.exact import tiered

    monkeypatch.setattr(tiered, "MAX_CHECKED_KEYS", 2_000)
    cache = TieredCache([(Tier.L1, MemoryStore(1 << 20))], clock=FakeClock())
    cache.endorsement_check_s = 3600.0
    held = entry(created_s=990.0)
    failures: list[BaseException] = []

    def hits(worker: int) -> None:
        try:
            for i in range(40_000):
                cache._check_endorsements(f"{worker}-{i}", held, None)
        except BaseException as exc:  # noqa: BLE001 - what the test looks for
            failures.append(exc)

    import sys

    threads = [threading.Thread(target=hits, args=(w,)) for w in range(3)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads take turns often: the race shows in most runs
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
    cache.close()


def test_a_key_sweep_spares_an_answer_written_between_its_read_and_its_delete() -> None:
    class Interleaved(MemoryStore):
        """A store where another process writes a new answer right after the sweep's read."""

        def peek(self, key: str) -> CacheEntry | None:
            held = super().peek(key)
            self.put(key, entry(created_s=2_000.0))  # generated again, after the watermark
            return held

    store = Interleaved(1 << 20)
    store.put("k", entry(created_s=900.0))
    assert sweep(store, Invalidation(InvalidationKind.KEY, "k", 1_000.0)) == []
    kept = MemoryStore.peek(store, "k")
    assert kept is not None and kept.created_s == 2_000.0


class _WritesAfterScan:
    """A store whose scan, once read to its end, sees `key` written again with `fresh` (a
    request generating the answer again while a sweep over a large store runs)."""

    def __init__(self, inner: Store, key: str, fresh: CacheEntry) -> None:
        self.inner, self.key, self.fresh = inner, key, fresh

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        yield from self.inner.scan()
        self.inner.put(self.key, self.fresh)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.parametrize("kind", ["l1", "l2"])
def test_a_sweep_keeps_an_answer_written_again_after_its_scan(tmp_path: Path, kind: str) -> None:
    """A tenant's (tag's, adapter's) sweep scans the whole store and then deletes: an answer
    generated again between the two (after the watermark) was deleted with the old ones."""
    store: Store = MemoryStore(1 << 20) if kind == "l1" else LmdbStore(tmp_path / "l2", 1 << 22)
    store.put("old", entry(100.0, tenant_scope="tenant-a"))
    store.put("again", entry(100.0, tenant_scope="tenant-a"))
    fresh = entry(300.0, tenant_scope="tenant-a")  # generated after the invalidation at 200
    racing = _WritesAfterScan(store, "again", fresh)
    inv = Invalidation(InvalidationKind.TENANT, "tenant-a", 200.0)
    assert sorted(sweep(racing, inv)) == ["old"]  # type: ignore[arg-type]
    assert store.peek("old") is None
    assert store.peek("again") == fresh


def test_heard_watermarks_are_kept_once_and_their_markers_leave_with_them(tmp_path: Path) -> None:
    """Every process of a host hears the same invalidations from Redis: the host's log keeps
    each once (a newer one for the same value again); a trimmed record takes its marker with
    it, so the value can be kept again later."""
    marks = HostWatermarks(tmp_path / "log", max_events=2, horizon_s=10.0, clock=lambda: 1000.0)
    first = Invalidation(InvalidationKind.KEY, "a", 100.0)
    assert marks.keep_heard([first, first]) == 1
    assert marks.keep_heard([first]) == 0  # another process heard it too
    assert marks.keep_heard([Invalidation(InvalidationKind.KEY, "a", 200.0)]) == 1  # newer
    table = InvalidationTable()
    assert marks.catch_up(table) == 2
    later = [Invalidation(InvalidationKind.TAG, v, at) for v, at in (("b", 300.0), ("c", 400.0))]
    assert marks.keep_heard(later) == 2  # room made: the two "a" records are trimmed
    assert marks.keep_heard(later) == 0  # another process's: nothing made room for them
    assert marks.catch_up(InvalidationTable()) == 2  # the log as it was: b and c
    assert marks.keep_heard([Invalidation(InvalidationKind.KEY, "a", 200.0)]) == 1
    young = HostWatermarks(tmp_path / "young", max_events=2, horizon_s=10.0, clock=lambda: 1.0)
    heard = [Invalidation(InvalidationKind.KEY, v, 0.5) for v in ("x", "y", "z")]
    assert young.keep_heard(heard) == 2 and young.heard_not_kept == 1  # a copy: never past max
