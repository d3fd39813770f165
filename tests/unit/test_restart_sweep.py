"""The L2 sweep a restarted replica runs for the watermarks issued while it was down
(tiercache.exact.invalidation.RestartSweeper), without Redis: the table is filled as the
listener's first catch-up fills it; with Redis: tests/integration/test_durable_invalidation.py."""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import RestartSweeper
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import HostWatermarks, Invalidation
from tiercache.vocabulary import InvalidationKind, Tier

T, K = InvalidationKind.TAG, InvalidationKind.KEY


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Host:
    cache: TieredCache
    l2: LmdbStore
    marks: HostWatermarks
    clock: FakeClock


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    clock = FakeClock()
    l2 = LmdbStore(tmp_path / "l2", 1 << 20, clock=clock)
    marks = HostWatermarks(tmp_path / "invalidations", clock=clock)
    cache = TieredCache(
        [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, l2)], clock=clock, host_marks=marks
    )
    yield Host(cache, l2, marks, clock)
    cache.close()


def keys(store: LmdbStore) -> list[str]:
    return sorted(key for key, _ in store.scan())


def test_a_restart_sweep_removes_what_watermarks_since_the_last_sweep_cover(host: Host) -> None:
    host.l2.put("kb1", CacheEntry("a", 900.0, tags=("kb:v1",)))
    host.l2.put("kb1-later", CacheEntry("b", 990.0, tags=("kb:v1",)))  # after the watermark
    host.l2.put("k", CacheEntry("c", 900.0))
    host.l2.put("kept", CacheEntry("d", 900.0, tags=("kb:v2",)))
    table = host.cache.invalidations
    # What the listener's first catch-up notes: recorded in Redis while this host was down.
    table.note(Invalidation(T, "kb:v1", 950.0), from_redis=True)
    table.note(Invalidation(K, "k", 960.0), from_redis=True)
    sweeper = RestartSweeper(host.cache, host.marks)
    first = sweeper.sweep()
    assert first is not None
    assert (first.watermarks, first.removed, first.swept_until_s) == (2, 2, 960.0)
    assert keys(host.l2) == ["kb1-later", "kept"]
    assert host.marks.swept_until_s() == 960.0

    again = sweeper.sweep()  # nothing newer than the last sweep: L2 is not even scanned
    assert again is not None and (again.watermarks, again.removed) == (0, 0)
    assert again.swept_until_s == 960.0

    table.note(Invalidation(T, "kb:v2", 970.0), from_redis=True)
    third = RestartSweeper(host.cache, host.marks).sweep()  # as the next start would
    assert third is not None and (third.watermarks, third.removed) == (1, 1)
    assert keys(host.l2) == ["kb1-later"] and host.marks.swept_until_s() == 970.0


def test_the_host_log_is_noted_before_the_sweep(host: Host) -> None:
    """Watermarks another process of the host recorded (Redis down when it issued them)."""
    host.l2.put("k", CacheEntry("a", 900.0, tags=("kb",)))
    host.marks.record(Invalidation(T, "kb", 950.0))
    report = RestartSweeper(host.cache, host.marks).sweep()
    assert report is not None and report.removed == 1 and keys(host.l2) == []


def test_the_thread_sweeps_once_ready_and_is_joined(host: Host) -> None:
    host.l2.put("k", CacheEntry("a", 900.0, tags=("kb",)))
    host.cache.invalidations.note(Invalidation(T, "kb", 950.0), from_redis=True)
    ready = threading.Event()
    sweeper = RestartSweeper(host.cache, host.marks, ready=ready.wait, poll_s=0.01).start()
    assert keys(host.l2) == ["k"]  # not before the table is known to be complete
    ready.set()
    report = sweeper.wait(10.0)
    assert report is not None and report.removed == 1
    sweeper.close()
    assert keys(host.l2) == []


def test_closing_while_another_process_sweeps_records_nothing(host: Host) -> None:
    host.l2.put("k", CacheEntry("a", 900.0, tags=("kb",)))
    host.cache.invalidations.note(Invalidation(T, "kb", 950.0), from_redis=True)
    lock_path = host.marks.path.with_name(host.marks.path.name + ".sweep-lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process of the host is sweeping
        sweeper = RestartSweeper(host.cache, host.marks, poll_s=0.01).start()
        sweeper.close()  # returns: the wait for the lock is abandoned
    finally:
        os.close(fd)
    assert sweeper.report is None and host.marks.swept_until_s() is None
    assert keys(host.l2) == ["k"]  # the next start sweeps it; reads refuse it meanwhile
    assert host.cache.get("k") is None
