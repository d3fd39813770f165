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

Forgetting: a watermark may be forgotten only once no tier can still hold an entry it covers
that some reader would serve, or the answer it killed comes back (an L3 left unswept with
`sweep_shared: false`, the L2 of a replica that was down). The bound is the entry lifetime
horizon, the deployment's `ttl_s`: every reader refuses an answer older than that, whatever
tier holds it. A watermark older than the horizon plus the skew allowance
(`forget_before_s`) covers only answers nobody serves; with no horizon (`ttl_s` 0: answers
never expire) none is ever forgotten. `max_events` is when forgetting is tried, not a cap: past
it, whatever is too young to forget is kept (memory grows, counted and warned about), so a
finite `ttl_s` is what bounds the table, the host's log and Redis's.

This module is what `TieredCache` reads, so it imports no cache and no tier: what acts on a
cache (the sweep, the Redis listener, the issuer) is `tiercache.exact.invalidation`.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import math
import struct
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import check_readers, open_lmdb
from tiercache.log_throttle import LogThrottle
from tiercache.vocabulary import InvalidationKind

log = logging.getLogger(__name__)

DEFAULT_SKEW_S = 0.05
DEFAULT_MAX_EVENTS = 100_000
# What `Invalidation.from_json` raises on a record that is not one (bad JSON, a list, a null
# at_s): such a record is skipped, never the end of reading the ones after it
MALFORMED_RECORD = (ValueError, KeyError, TypeError, AttributeError)
_WARN_EVERY_S = 60.0  # at most one "kept past max_events" warning per table or log this often


def forget_before_s(now_s: float, horizon_s: float | None, skew_s: float) -> float | None:
    """Watermarks with `at_s` before this can be forgotten at `now_s`; None: none can (no
    horizon). The one rule for the table, the host's log and Redis's.

    A watermark kills entries with `created_s <= at_s + skew_s`, and no reader serves an entry
    older than `horizon_s` (`TieredCache.default_ttl_s`). Once `now_s - at_s > horizon_s +
    2 * skew_s`, every entry it covers is older than the horizon by the reader's clock even if
    that clock runs up to `skew_s` behind the one that forgets (`at_s` is Redis's, `now_s` the
    caller's): the skew allowance counts once for the writer's clock, once for the reader's."""
    if horizon_s is None:
        return None
    return now_s - horizon_s - 2 * skew_s


def _horizon(horizon_s: float | None) -> float | None:
    """`horizon_s` checked: None or 0 is no horizon; a positive finite number of seconds."""
    if not horizon_s:
        return None
    if not math.isfinite(horizon_s) or horizon_s < 0:
        raise ValueError(f"horizon_s must be a positive number of seconds or None, got {horizon_s}")
    return horizon_s


class OverflowCounter:
    """Counts what is kept past `max_events` and warns about it at most once a minute."""

    __slots__ = ("what", "count", "_warned_s")

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._warned_s = -math.inf

    def kept(self, held: int, max_events: int, horizon_s: float | None, now_s: float) -> None:
        self.count += 1
        if now_s - self._warned_s < _WARN_EVERY_S:
            return
        self._warned_s = now_s
        why = (
            f"none of the oldest is past the entry lifetime horizon (ttl_s {horizon_s:g} s)"
            if horizon_s is not None
            else "ttl_s is 0: answers never expire, so no watermark may be forgotten"
        )
        log.warning(
            "%s holds %d invalidation watermarks, more than max_events (%d), and keeps them: %s "
            "(forgetting one could serve an unswept copy again). A finite ttl_s bounds it",
            self.what,
            held,
            max_events,
            why,
        )


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
        """What it invalidates, `<kind>:<value>`: the end of its member in the Redis sorted set
        (`tiercache.exact.invalidation.signed_member` puts the tag and `at_s` before it, so a
        later invalidation of the same thing is a member of its own and replaces nothing; the
        table keeps the newest `at_s` per `<kind>:<value>`)."""
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
    lock; readers do plain dict look-ups (atomic in CPython).

    Forgets only what no reader could be served any more (the module docstring): past
    `max_events`, the watermarks older than the horizon `horizon_s` (the cache's `ttl_s`; None:
    none) plus the skew allowance, by the injected `clock` (the cache's wall clock). What is too
    young stays, however many: `kept_past_max` counts the notes that left the table over
    `max_events`, and a warning is logged at most once a minute. A heap ordered by `at_s` makes
    forgetting cost O(log n) per watermark forgotten, never a sort of the table."""

    def __init__(
        self,
        skew_s: float = DEFAULT_SKEW_S,
        max_events: int = DEFAULT_MAX_EVENTS,
        horizon_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.skew_s = skew_s
        self.max_events = max_events
        self.horizon_s = _horizon(horizon_s)
        self.origin = uuid.uuid4().hex
        self._clock = clock
        self._marks: dict[InvalidationKind, dict[str, float]] = {k: {} for k in InvalidationKind}
        # (at_s, kind, value) of every note, oldest first; entries a later note superseded are
        # skipped when popped, and the heap is rebuilt when they outnumber the live ones.
        self._order: list[tuple[float, str, str]] = []
        self._count = 0
        self._forgotten = 0
        self._overflow = OverflowCounter("this process's invalidation table")
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
            heapq.heappush(self._order, (inv.at_s, inv.kind.value, inv.value))
            if from_redis:
                self.newest_s = max(self.newest_s, inv.at_s)
            if self._count > self.max_events:
                self._forget_old()
            if len(self._order) > 2 * self._count + 1024:  # mostly superseded notes: rebuild
                self._rebuild_order()
            return True

    def _rebuild_order(self) -> None:
        marks = self._marks
        self._order = [
            (at, k.value, v) for k, by_value in marks.items() for v, at in by_value.items()
        ]
        heapq.heapify(self._order)

    def _forget_old(self) -> None:
        now_s = self._clock()
        cutoff = forget_before_s(now_s, self.horizon_s, self.skew_s)
        order = self._order
        while cutoff is not None and order and order[0][0] < cutoff:
            at_s, kind, value = heapq.heappop(order)
            marks = self._marks[InvalidationKind(kind)]
            if marks.get(value) == at_s:  # else a later note superseded this one
                del marks[value]
                self._count -= 1
                self._forgotten += 1
        if self._count > self.max_events:
            self._overflow.kept(self._count, self.max_events, self.horizon_s, now_s)

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

    def since(self, after_s: float | None) -> list[Invalidation]:
        """The watermarks with `at_s` after `after_s` (None: all), oldest first: what a sweep
        since `after_s` has to apply. O(n): for the sweep at start, not the request path."""
        with self._lock:
            found = [
                Invalidation(kind, value, at_s)
                for kind, marks in self._marks.items()
                for value, at_s in marks.items()
                if after_s is None or at_s > after_s
            ]
        return sorted(found, key=lambda inv: inv.at_s)

    @property
    def forgotten(self) -> int:
        """Watermarks forgotten because they were older than the horizon."""
        with self._lock:
            return self._forgotten

    @property
    def kept_past_max(self) -> int:
        """Notes that left the table over `max_events`, nothing in it being old enough to
        forget (each also considered for the once-a-minute warning)."""
        with self._lock:
            return self._overflow.count

    def __len__(self) -> int:
        return self._count


class HostWatermarks:
    """The watermarks issued on this host, in an LMDB file every process of the host reads
    (`<state>/invalidations`). Without Redis this is how an invalidation reaches the other
    processes: prompt_cache's L1 copies, an answer an llm process was generating while the sweep
    ran (it is written after the sweep, with a `created_s` before the watermark), the answers
    embedding_cache serves. Each read of a `TieredCache` first notes what was recorded since its
    last read (one small read transaction when nothing is new).

    Records are numbered, and forgotten oldest first by `InvalidationTable`'s rule: past
    `max_events`, those older than `horizon_s` plus the skew allowance, by `clock`; a younger
    one stops the trim (the ones after it are kept too), and what is kept past `max_events` is
    counted (`kept_past_max`) and warned about at most once a minute.

    It also keeps when this host's L2 was last swept against the watermarks
    (`swept_until_s`/`mark_swept`; `tiercache.exact.invalidation.RestartSweeper`)."""

    _SEQ = b"seq"
    _SWEPT = b"swept"  # the newest at_s the last completed L2 sweep at start applied
    _FLOAT = struct.Struct(">d")

    def __init__(
        self,
        path: Path,
        max_events: int = DEFAULT_MAX_EVENTS,
        map_bytes: int = 64 << 20,
        *,
        horizon_s: float | None = None,
        skew_s: float = DEFAULT_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.max_events = max_events
        self.horizon_s = _horizon(horizon_s)
        self.skew_s = skew_s
        self._clock = clock
        self._env = open_lmdb(path, map_bytes, "invalidation log")
        self._seen = 0
        self._lock = threading.Lock()
        self._forgotten = 0
        self._heard_not_kept = 0
        self._heard_log = LogThrottle()
        self._overflow = OverflowCounter(f"the host's invalidation log {path}")

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
            cursor = txn.cursor()
            if not cursor.set_range(b"e"):
                return
            first = int.from_bytes(cursor.key()[1:], "big")
            if seq - first + 1 > self.max_events:
                self._trim(cursor, seq - first + 1, txn)

    @staticmethod
    def _heard_key(inv: Invalidation) -> bytes:
        """The marker of a watermark heard from Redis (`keep_heard`): one per kind and value."""
        name = f"{inv.kind.value}\n{inv.value}".encode("utf-8", "surrogatepass")
        return b"h" + hashlib.sha256(name).digest()[:16]

    def keep_heard(self, invs: list[Invalidation]) -> int:
        """Append the watermarks this host heard from Redis, in one transaction, each unless
        the log already holds it at least as new (every process of the host hears the same
        ones): a process of this host started later learns them from here even when Redis no
        longer has them (restarted without persistence; members deleted by whoever can write
        to it: signatures stop forged records, not deleted ones). How many were appended.
        A copy, so it never takes the log past `max_events` (the oldest past the horizon are
        forgotten first): the ones that do not fit are left to Redis's record, counted in
        `heard_not_kept` (the host's own invalidations are always recorded)."""
        if not invs:
            return 0
        appended = left_out = 0
        with self._env.begin(write=True) as txn:
            fresh: dict[bytes, Invalidation] = {}  # the log holds none of them yet
            for inv in invs:
                marker = self._heard_key(inv)
                kept = txn.get(marker)
                if kept is not None and self._FLOAT.unpack(bytes(kept))[0] >= inv.at_s:
                    continue
                if marker not in fresh or fresh[marker].at_s < inv.at_s:
                    fresh[marker] = inv
            if not fresh:
                return 0
            raw = txn.get(self._SEQ)
            seq = int.from_bytes(raw, "big") if raw else 0
            cursor = txn.cursor()
            held = 0
            if cursor.set_range(b"e") and cursor.key().startswith(b"e"):
                held = seq - int.from_bytes(cursor.key()[1:], "big") + 1
                if held + len(fresh) > self.max_events:  # room for them, as far as it goes
                    held = self._trim(cursor, held + len(fresh), txn, warn=False) - len(fresh)
            for marker, inv in fresh.items():
                if held + appended >= self.max_events:
                    left_out += 1
                    continue
                seq += 1
                txn.put(self._key(seq), inv.to_json().encode())
                txn.put(marker, self._FLOAT.pack(inv.at_s))
                appended += 1
            if appended:
                txn.put(self._SEQ, seq.to_bytes(8, "big"))
        if left_out:
            with self._lock:
                self._heard_not_kept += left_out
            if self._heard_log.ready():
                log.warning(
                    "the host's invalidation log %s holds max_events (%d) records: %d heard "
                    "from Redis not kept in it (%d in all; they hold in the running processes "
                    "and in Redis's record)",
                    self.path,
                    self.max_events,
                    left_out,
                    self.heard_not_kept,
                )
        return appended

    @property
    def heard_not_kept(self) -> int:
        """Watermarks heard from Redis that this process left out of the host's log (full)."""
        with self._lock:
            return self._heard_not_kept

    def _trim(self, cursor: Any, held: int, txn: Any = None, warn: bool = True) -> int:
        """Forget the oldest records that are past the horizon while more than `max_events`
        are held; `cursor` is on the oldest (`txn`, its transaction, for the markers of heard
        records: a marker goes with the record it was written for). `held` less those
        forgotten."""
        now_s = self._clock()
        cutoff = forget_before_s(now_s, self.horizon_s, self.skew_s)
        forgotten = 0
        while cutoff is not None and held > self.max_events and cursor.key().startswith(b"e"):
            try:
                old: Invalidation | None = Invalidation.from_json(bytes(cursor.value()))
                at_s = old.at_s if old is not None else -math.inf
            except MALFORMED_RECORD as exc:
                log.warning("dropping a malformed invalidation record: %s", exc)
                old, at_s = None, -math.inf
            if at_s >= cutoff:
                break
            if txn is not None and old is not None:
                marker = self._heard_key(old)
                kept = txn.get(marker)
                if kept is not None and self._FLOAT.unpack(bytes(kept))[0] <= at_s:
                    txn.delete(marker)
            cursor.delete()  # moves to the next record
            held -= 1
            forgotten += 1
        with self._lock:
            self._forgotten += forgotten
            if held > self.max_events and warn:  # a copy (`keep_heard`) only makes room
                self._overflow.kept(held, self.max_events, self.horizon_s, now_s)
        return held

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
                        except MALFORMED_RECORD as exc:  # skipped: the ones after it still count
                            log.warning("skipping a malformed invalidation record: %s", exc)
                self._seen = max(self._seen, newest)
                return noted

    def swept_until_s(self) -> float | None:
        """The newest `at_s` the last completed sweep of this host's L2 applied (every watermark
        up to it had been applied to L2 then); None before the first."""
        with self._env.begin() as txn:
            raw = txn.get(self._SWEPT)
        return None if raw is None else float(self._FLOAT.unpack(bytes(raw))[0])

    def mark_swept(self, until_s: float) -> None:
        """Record a completed sweep of this host's L2 up to `until_s` (it never moves back)."""
        with self._env.begin(write=True) as txn:
            raw = txn.get(self._SWEPT)
            if raw is not None and self._FLOAT.unpack(bytes(raw))[0] >= until_s:
                return
            txn.put(self._SWEPT, self._FLOAT.pack(until_s))

    @property
    def forgotten(self) -> int:
        """Records this process forgot because they were older than the horizon."""
        with self._lock:
            return self._forgotten

    @property
    def kept_past_max(self) -> int:
        """Records this process appended that left the log over `max_events`."""
        with self._lock:
            return self._overflow.count

    def reader_check(self) -> int:
        """Free reader slots of dead processes (done at open too); how many."""
        return check_readers(self._env, "invalidation log", self.path)

    def close(self) -> None:
        self._env.close()
