"""tiercache.exact.l2_values: L2's GreedyDual-Size-Frequency values, shared through a file by
the host's processes (two L2Values on one path stand for two processes), and L2 evicting by
them (real LMDB)."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest

from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.codec import MAX_ENDORSEMENTS, CacheEntry
from tiercache.exact.invalidation import Invalidator
from tiercache.exact.l2_values import FLUSH_INTERVAL_S, MIN_MAP_BYTES, L2Values
from tiercache.exact.stores import LmdbStore
from tiercache.exact.tiered import TieredCache
from tiercache.feedback import Feedback, Verdict
from tiercache.vocabulary import Tier


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def values(path: Path, ticks: Ticks | None = None) -> L2Values:
    return L2Values(path / "l2-values", MIN_MAP_BYTES, monotonic=ticks or Ticks())


def test_an_admission_counts_a_request_at_its_cost_per_byte_and_hits_add_when_flushed(
    tmp_path: Path,
) -> None:
    ticks = Ticks()
    v = values(tmp_path, ticks)
    v.admitted("a", 100, 5.0, created_s=1.0)
    assert v.value("a") == (pytest.approx(0.05), 1)
    v.hit("a")
    v.hit("a")
    assert v.value("a") == (pytest.approx(0.05), 1)  # counted here, not written yet
    ticks.now += FLUSH_INTERVAL_S
    v.hit("a")  # due: this hit writes all three
    assert v.value("a") == (pytest.approx(0.2), 4)
    # the same answer written again with two verdicts (an endorsement): the verdicts only
    v.admitted("a", 100, 5.0, endorsements=2, created_s=1.0)
    assert v.value("a") == (pytest.approx(0.3), 6)
    v.admitted("a", 100, 5.0, endorsements=2, created_s=1.0)  # a refill: nothing new
    assert v.value("a") == (pytest.approx(0.3), 6)
    v.admitted("a", 100, 5.0, endorsements=3, created_s=1.0)  # one more verdict
    assert v.value("a") == (pytest.approx(0.35), 7)
    # a new answer under the key (generated again): one more request, the count goes on
    v.admitted("a", 100, 5.0, created_s=2.0)
    assert v.value("a") == (pytest.approx(0.4), 8)
    v.close()


def test_an_unknown_cost_counts_as_the_mean_known_one(tmp_path: Path) -> None:
    v = values(tmp_path)
    v.admitted("first", 10, 0.0)  # nothing known yet: 1 second
    assert v.value("first") == (pytest.approx(0.1), 1)
    v.admitted("b", 10, 2.0)
    v.admitted("c", 10, 4.0)
    v.admitted("unknown", 10, 0.0)
    assert v.value("unknown") == (pytest.approx(0.3), 1)
    v.close()


def test_two_processes_share_the_values(tmp_path: Path) -> None:
    """Another process (a real one: LMDB opens an environment once per process) reads
    `popular` and writes its hit; this one then evicts the entry nobody read."""
    writer = values(tmp_path)
    writer.admitted("popular", 10, 1.0)
    writer.admitted("one-off", 10, 1.0)
    reader = (
        "import sys; from pathlib import Path; from tiercache.exact.l2_values import L2Values\n"
        "v = L2Values(Path(sys.argv[1]), int(sys.argv[2])); v.hit('popular'); v.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(
        [sys.executable, "-c", reader, str(tmp_path / "l2-values"), str(MIN_MAP_BYTES)],
        check=True,
        env=env,
        timeout=60,
    )
    assert writer.value("popular") == (pytest.approx(0.2), 2)
    assert writer.nominate([(b"popular", 1.0), (b"one-off", 2.0)], 1) == [b"one-off"]
    writer.close()


def test_eviction_takes_the_lowest_value_first_and_an_unrecorded_entry_ranks_as_fresh(
    tmp_path: Path,
) -> None:
    """An entry without a record (its admission failed, or a stage set to oldest wrote it)
    ranks as a fresh admission of the median weight, not first: a failure must not make the
    newest entries the first to go."""
    v = values(tmp_path)
    v.admitted("cheap", 10, 1.0)  # 0.1
    v.admitted("middle", 10, 2.0)  # 0.2
    v.admitted("dear", 10, 30.0)  # 3.0
    entries = [(b"dear", 1.0), (b"cheap", 2.0), (b"middle", 3.0), (b"unknown", 0.5)]
    # unknown: L 0 + the median weight 0.2, ties with "middle" and older
    assert v.nominate(entries, 4) == [b"cheap", b"unknown", b"middle", b"dear"]
    v.close()


def test_an_eviction_raises_the_level_and_forgets_what_left(tmp_path: Path) -> None:
    v = values(tmp_path)
    v.admitted("a", 10, 1.0)  # 0.1
    v.admitted("b", 10, 2.0)  # 0.2
    v.admitted("c", 10, 3.0)
    v.hit("b")
    v.flush()  # b was asked for once more: the eviction gives that up
    assert v.evicted([b"a", b"b"]) == 1
    assert v.inflation() == pytest.approx(0.4)  # b's value with its hit: 0.0 + 2 x 0.2
    assert v.value("a") is None and v.value("b") is None
    assert v.value("c") == (pytest.approx(0.3), 1)  # written meanwhile or not: kept
    v.admitted("d", 10, 1.0)  # the level now: 0.4 + 0.1
    assert v.value("d") == (pytest.approx(0.5), 1)
    v.forget([b"c"])  # deleted from L2 (an invalidation): its record goes, L stays
    assert v.value("c") is None and v.inflation() == pytest.approx(0.4)
    v.forget_all()
    assert v.value("d") is None and v.inflation() == pytest.approx(0.4)
    v.close()


def test_the_file_starts_empty_after_a_reboot_or_when_its_meta_is_damaged(tmp_path: Path) -> None:
    """Not flushed at each commit: after the machine restarts its pages may be half written,
    so a file written under another boot is rebuilt empty; so is one whose level is not a
    number (it would stick: max(nan, x) is nan)."""
    first = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, boot=b"A" * 16)
    first.admitted("a", 10, 1.0)
    first.evicted([b"a"])
    assert first.inflation() > 0.0
    first.admitted("b", 10, 1.0)
    first.close()
    same = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, boot=b"A" * 16)
    assert same.value("b") is not None  # the same boot: kept
    same.close()
    rebooted = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, boot=b"B" * 16)
    assert rebooted.value("b") is None and rebooted.inflation() == 0.0
    rebooted.close()
    env = lmdb.open(str(tmp_path / "l2-values"), map_size=MIN_MAP_BYTES)
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(b"\x00meta"))
        raw[20:28] = struct.pack("<d", math.nan)  # L
        txn.put(b"\x00meta", bytes(raw))
        txn.put(b"x", struct.pack("<ddIId", 1.0, 1.0, 1, 0, 0.0))
    env.close()
    damaged = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, boot=b"B" * 16)
    assert damaged.inflation() == 0.0 and damaged.value("x") is None
    damaged.close()


def test_a_damaged_record_counts_as_none(tmp_path: Path) -> None:
    v = values(tmp_path)
    v.admitted("a", 10, 1.0)
    v.close()
    env = lmdb.open(str(tmp_path / "l2-values"), map_size=MIN_MAP_BYTES)
    with env.begin(write=True) as txn:
        txn.put(b"a", b"short")
    env.close()
    v = values(tmp_path)
    assert v.value("a") is None
    assert v.nominate([(b"a", 1.0), (b"b", 0.0)], 1) == [b"b"]  # both unknown: oldest first
    v.admitted("a", 10, 1.0)  # written over
    assert v.value("a") == (pytest.approx(0.1), 1)
    v.close()


def test_values_that_fail_are_logged_and_never_fail_l2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    v = values(tmp_path)
    v._env.close()  # every read and write of the values now raises
    assert v.nominate([(b"a", 1.0)], 1) is None  # L2 then evicts oldest first
    v.admitted("a", 10, 1.0)  # logged, not raised
    v.hit("a")
    v.flush()
    v.evicted([b"a"])
    v.forget([b"a"])
    assert "L2 values" in caplog.text


def hot_reads(store: LmdbStore, ticks: Ticks, keys: list[str], hot: list[str]) -> list[bool]:
    """Write `keys` in order, each read back `hot` keys after every write (once written);
    whether each read hit."""
    hits = []
    for i, key in enumerate(keys):
        store.put(key, CacheEntry("x" * 1_000, float(i), generation_s=1.0))
        ticks.now += FLUSH_INTERVAL_S  # every hit below is written at once
        hits += [store.get(h) is not None for h in hot if keys.index(h) <= i]
    return hits


def test_l2_with_values_keeps_what_is_asked_for_where_oldest_first_drops_it(
    tmp_path: Path,
) -> None:
    """A tiny L2: the first entries are read after every write; oldest first evicts them in
    its first eviction, the values keep them through every one."""
    keys = [f"k{i:05d}" for i in range(600)]
    hot = keys[:3]
    plain = LmdbStore(tmp_path / "plain", 256 * 1024)
    plain_hits = hot_reads(plain, Ticks(), keys, hot)
    assert plain.stats().evictions > 0
    assert not any(plain_hits[-len(hot) :])  # gone, though read all along
    plain.close()

    ticks = Ticks()
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, monotonic=ticks)
    store = LmdbStore(tmp_path / "l2", 256 * 1024, values=v)
    assert all(hot_reads(store, ticks, keys, hot))
    stats = store.stats()
    assert stats.evictions > 0 and stats.entries < len(keys)
    assert v.inflation() > 0.0
    store.close()


def test_l2_evicts_a_cheap_answer_before_a_dear_one(tmp_path: Path) -> None:
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES)
    store = LmdbStore(tmp_path / "l2", 256 * 1024, values=v)
    store.put("dear", CacheEntry("x" * 1_000, 0.0, generation_s=30.0))
    for i in range(600):
        store.put(f"cheap{i:04d}", CacheEntry("x" * 1_000, float(i + 1), generation_s=0.5))
    assert store.stats().evictions > 0
    assert store.get("dear") is not None  # the oldest, and kept: thirty times the cost
    store.close()


def test_the_skew_is_the_hottest_hundredths_share_of_repeat_requests(tmp_path: Path) -> None:
    v = values(tmp_path)
    assert v.skew() == 0.0  # before any eviction
    keys = [f"k{i:03d}" for i in range(201)]
    for key in keys:
        v.admitted(key, 10, 1.0)
    for _ in range(6):
        v.hit("k000")
        v.hit("k001")
    for key in keys[2:6]:
        v.hit(key)
    v.flush()
    v.evicted([keys[-1].encode()])
    # 200 held: the hottest 1 % is two entries, 12 of the 16 repeat requests
    assert v.skew() == pytest.approx(12 / 16)
    v.close()


def test_l2_reports_what_its_evictions_gave_up_its_deletions_and_skew(tmp_path: Path) -> None:
    ticks = Ticks()
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, monotonic=ticks)
    store = LmdbStore(tmp_path / "l2", 256 * 1024, values=v)
    assert store.stats().hit_skew == 0.0  # with values: reported (0 before an eviction)
    keys = [f"k{i:05d}" for i in range(600)]
    hot_reads(store, ticks, keys, keys[:3])
    store.put("doomed", CacheEntry("x", 1e9))
    assert store.delete("doomed")
    stats = store.stats()
    assert stats.evictions > 0 and stats.removed == 1
    # the three read entries take every repeat request, evenly; the hottest 1 % of the
    # entries left after the last eviction is one of them
    assert stats.hit_skew is not None
    assert stats.hit_skew == pytest.approx(1 / 3, abs=0.01)
    store.close()
    plain = LmdbStore(tmp_path / "plain", 1 << 20)
    assert plain.stats().hit_skew is None  # no values: no requests per entry counted
    plain.close()


def test_the_cache_tells_an_answers_value_from_its_l2(tmp_path: Path) -> None:
    """TieredCache.answer_value: what the semantic rows' compaction ranks by."""
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES)
    valued = TieredCache([(Tier.L2, LmdbStore(tmp_path / "l2", 1 << 20, values=v))])
    valued.put("dear", "x", generation_s=30.0)
    valued.put("cheap", "x", generation_s=0.5)
    assert valued.answer_value("dear") > valued.answer_value("cheap") > 0.0
    assert valued.answer_value("never-stored") == 0.0
    valued.close()
    plain = TieredCache([(Tier.L2, LmdbStore(tmp_path / "plain", 1 << 20))])
    plain.put("dear", "x", generation_s=30.0)
    assert plain.answer_value("dear") == 0.0  # no values: every answer alike
    plain.close()


def test_each_good_verdict_is_worth_one_request_in_l2_and_reading_the_answer_none(
    tmp_path: Path,
) -> None:
    """Feedback reads the answer without counting a hit, and its rewrite adds the one verdict
    it carries: three verdicts on an answer written once make four requests, and a fourth (over
    MAX_ENDORSEMENTS) or a replay adds nothing."""
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES)
    cache = TieredCache([(Tier.L2, LmdbStore(tmp_path / "l2", 1 << 20, values=v))])
    cache.put("d" * 64, "an answer", tenant_scope="s", generation_s=2.0)
    ids = AnswerIds(bytes(range(32)))
    feedback = Feedback(ids, Invalidator(cache))
    answer_id = ids.issue(AnswerRef("d" * 64, ServedAs.OWN, issued_s=cache.now()), "s")
    for _ in range(MAX_ENDORSEMENTS):
        assert feedback.give(answer_id, Verdict.GOOD, "s").endorsed
    assert not feedback.give(answer_id, Verdict.GOOD, "s").endorsed
    v.flush()
    found = v.value("d" * 64)
    assert found is not None and found[1] == 1 + MAX_ENDORSEMENTS
    cache.close()


def test_a_sweep_drops_records_of_entries_gone_but_not_of_entries_written_since(
    tmp_path: Path,
) -> None:
    now = [100.0]
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, clock=lambda: now[0])
    v.admitted("kept", 10, 1.0)
    v.admitted("orphan", 10, 1.0)  # deleted from L2 by a process that did not tell the values
    snapshot_s = now[0] = 101.0
    now[0] = 102.0
    v.admitted("new", 10, 1.0)  # written after the snapshot: absent from it, not an orphan
    assert v.sweep({b"kept"}, snapshot_s) == 1
    assert v.value("orphan") is None
    assert v.value("kept") is not None and v.value("new") is not None
    v.close()


def test_an_unrecorded_entry_from_before_the_last_eviction_ages(tmp_path: Path) -> None:
    """Ranked fresh at every eviction, an entry without a record would never go; made before
    the last eviction, it ranks at the level L, below what is asked for."""
    now = [10.0]
    v = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES, clock=lambda: now[0])
    v.admitted("gone", 10, 5.0)  # 0.5
    v.admitted("asked", 10, 1.0)
    v.hit("asked")
    v.flush()  # 0.2
    v.evicted([b"gone"])  # L = 0.5, the last eviction at 10.0
    v.admitted("fresh", 10, 1.0)  # 0.5 + 0.1
    entries = [
        (b"asked", 1.0),
        (b"fresh", 11.0),
        (b"old-unrecorded", 5.0),
        (b"new-unrecorded", 11.0),
    ]
    # asked 0.2 (stale), old unrecorded at L 0.5, fresh 0.6, new unrecorded 0.5 + median 0.1
    assert v.nominate(entries, 4) == [b"asked", b"old-unrecorded", b"fresh", b"new-unrecorded"]
    v.close()
