"""Invalidation watermarks: what this process knows is dead, checked on every read.

An invalidation is a watermark: `(kind, value, at_s)` says "every entry that matches and whose
generation started at or before `at_s` is dead". Each process keeps the watermarks it has seen in
an `InvalidationTable`, and `TieredCache.get` checks every entry it finds against it (a few dict
look-ups; nothing when the table is empty), so a matching entry is never served again from any
tier once the table holds its watermark, whether or not it has been deleted yet. Without Redis,
`HostWatermarks` (an LMDB log every process of the host reads) carries the watermarks issued on
the host to its other processes.

Matching needs metadata in the entry (`CacheEntry.tags/tenant_scope/adapter`); `applies` is the
same rule as `InvalidationTable.covers`, for one watermark.

Times: `at_s` is Redis's clock (`TIME`), `created_s` the generating replica's wall clock; entries
created up to `skew_s` after the watermark are also dropped, to absorb clock skew between hosts.

This module is what `TieredCache` reads, so it imports no cache and no tier: what acts on a
cache (the sweep, the Redis listener, the issuer) is `tiercache.exact.invalidation`.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import open_lmdb
from tiercache.vocabulary import InvalidationKind

log = logging.getLogger(__name__)

DEFAULT_SKEW_S = 0.05
DEFAULT_MAX_EVENTS = 100_000


@dataclass(frozen=True, slots=True)
class Invalidation:
    kind: InvalidationKind
    value: str
    at_s: float  # entries whose generation started at or before this are dead
    origin: str = ""  # the table that issued it (its own listener skips it)
    # The issuer's clock (`TieredCache.now`) when it published; 0 when not published (a
    # watermark read back from Redis). Listeners measure their lag from it (metrics only).
    published_s: float = 0.0

    def member(self) -> str:
        """Its identity in the Redis sorted set: a later one for the same thing replaces it."""
        return f"{self.kind.value}:{self.value}"

    def to_json(self) -> str:
        return json.dumps(
            {
                "kind": self.kind.value,
                "value": self.value,
                "at_s": self.at_s,
                "origin": self.origin,
                "published_s": self.published_s,
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Invalidation:
        data = json.loads(text)
        kind = InvalidationKind(data["kind"])
        return cls(
            kind,
            str(data["value"]),
            float(data["at_s"]),
            str(data.get("origin", "")),
            float(data.get("published_s", 0.0)),
        )

    @classmethod
    def from_member(cls, member: str | bytes, at_s: float) -> Invalidation:
        text = member.decode() if isinstance(member, bytes) else member
        kind, _, value = text.partition(":")
        return cls(InvalidationKind(kind), value, at_s)


def applies(inv: Invalidation, key: str, entry: CacheEntry, skew_s: float = DEFAULT_SKEW_S) -> bool:
    """Whether `inv` kills `entry` (stored under `key`)."""
    if entry.created_s > inv.at_s + skew_s:
        return False
    if inv.kind is InvalidationKind.KEY:
        return key == inv.value
    if inv.kind is InvalidationKind.TAG:
        return inv.value in entry.tags
    if inv.kind is InvalidationKind.TENANT:
        return bool(entry.tenant_scope) and entry.tenant_scope == inv.value
    return bool(entry.adapter) and entry.adapter == inv.value


class InvalidationTable:
    """The watermarks this process has seen, checked on every read. Thread-safe: writers hold a
    lock; readers do plain dict look-ups (atomic in CPython). Bounded: past `max_events` the
    oldest tenth is forgotten (those invalidations have long been swept)."""

    def __init__(
        self, skew_s: float = DEFAULT_SKEW_S, max_events: int = DEFAULT_MAX_EVENTS
    ) -> None:
        self.skew_s = skew_s
        self.max_events = max_events
        self.origin = uuid.uuid4().hex
        self._marks: dict[InvalidationKind, dict[str, float]] = {k: {} for k in InvalidationKind}
        self._count = 0
        self._lock = threading.Lock()
        self.newest_s = 0.0  # the newest watermark seen

    def note(self, inv: Invalidation, from_redis: bool = False) -> bool:
        """Record `inv`; True if it raised a watermark (it was news). Only watermarks read from
        Redis (`from_redis`) move `newest_s`, from which the listener catches up after a
        reconnect: one stamped by this host's clock while Redis was away, or taken from the
        host's log, must not make it skip what others recorded meanwhile."""
        with self._lock:
            marks = self._marks[inv.kind]
            old = marks.get(inv.value)
            if old is not None and old >= inv.at_s:
                return False
            if old is None:
                self._count += 1
            marks[inv.value] = inv.at_s
            if from_redis:
                self.newest_s = max(self.newest_s, inv.at_s)
            if self._count > self.max_events:
                self._forget_oldest()
            return True

    def _forget_oldest(self) -> None:
        every = sorted((at, k, v) for k, marks in self._marks.items() for v, at in marks.items())
        for _, kind, value in every[: max(1, len(every) // 10)]:
            del self._marks[kind][value]
            self._count -= 1

    def covers(self, key: str, entry: CacheEntry) -> bool:
        """Whether a watermark this process has seen kills `entry`."""
        if not self._count:
            return False
        floor = entry.created_s - self.skew_s  # dead if some watermark >= floor
        marks = self._marks
        mark = marks[InvalidationKind.KEY].get(key)
        if mark is not None and mark >= floor:
            return True
        if entry.tenant_scope:
            mark = marks[InvalidationKind.TENANT].get(entry.tenant_scope)
            if mark is not None and mark >= floor:
                return True
        if entry.adapter:
            mark = marks[InvalidationKind.ADAPTER].get(entry.adapter)
            if mark is not None and mark >= floor:
                return True
        tags = marks[InvalidationKind.TAG]
        for tag in entry.tags:
            mark = tags.get(tag)
            if mark is not None and mark >= floor:
                return True
        return False

    def __len__(self) -> int:
        return self._count


class HostWatermarks:
    """The watermarks issued on this host, in an LMDB file every process of the host reads
    (`<state>/invalidations`). Without Redis this is how an invalidation reaches the other
    processes: prompt_cache's L1 copies, an answer an llm process was generating while the sweep
    ran (it is written after the sweep, with a `created_s` before the watermark), the answers
    embedding_cache serves. Each read of a `TieredCache` first notes what was recorded since its
    last read (one small read transaction when nothing is new). Records are numbered; the
    oldest are dropped past `max_events`, as `InvalidationTable` forgets them."""

    _SEQ = b"seq"

    def __init__(
        self, path: Path, max_events: int = DEFAULT_MAX_EVENTS, map_bytes: int = 64 << 20
    ) -> None:
        self.path = path
        self.max_events = max_events
        self._env = open_lmdb(path, map_bytes, "invalidation log")
        self._seen = 0
        self._lock = threading.Lock()

    @staticmethod
    def _key(seq: int) -> bytes:
        return b"e" + seq.to_bytes(8, "big")

    def record(self, inv: Invalidation) -> None:
        """Append `inv` (before the sweep: a process reading after the sweep has noted it)."""
        with self._env.begin(write=True) as txn:
            raw = txn.get(self._SEQ)
            seq = 1 + (int.from_bytes(raw, "big") if raw else 0)
            txn.put(self._key(seq), inv.to_json().encode())
            txn.put(self._SEQ, seq.to_bytes(8, "big"))
            if seq > self.max_events:
                txn.delete(self._key(seq - self.max_events))

    def catch_up(self, table: InvalidationTable) -> int:
        """Note in `table` every record since the last call; how many there were."""
        with self._env.begin(buffers=False) as txn:
            raw = txn.get(self._SEQ)
            newest = int.from_bytes(raw, "big") if raw else 0
            if newest <= self._seen:
                return 0
            with self._lock:
                start, noted = self._seen, 0
                cursor = txn.cursor()
                if cursor.set_range(self._key(start + 1)):
                    for key, value in cursor:
                        if not key.startswith(b"e"):
                            break
                        try:
                            table.note(Invalidation.from_json(value))
                            noted += 1
                        except (ValueError, KeyError) as exc:
                            log.warning("skipping a malformed invalidation record: %s", exc)
                self._seen = max(self._seen, newest)
                return noted

    def close(self) -> None:
        self._env.close()
