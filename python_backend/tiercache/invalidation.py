"""Invalidation by key, tag, tenant or adapter, on every tier of every replica.

An invalidation is a watermark: `(kind, value, at_s)` says "every entry that matches and whose
generation started at or before `at_s` is dead". Each process keeps the watermarks it has seen in
an `InvalidationTable`, and `TieredCache.get` checks every entry it finds against it (a few dict
look-ups; nothing when the table is empty), so a matching entry is never served again from any
tier once the table holds its watermark, whether or not it has been deleted yet. Deleting is the
second, eager step that gives the space back:

- The process that receives the command (`Invalidator`) notes the watermark, drops its own L1/L2
  copies, deletes from L3 (a key directly; a tag, tenant or adapter by scanning this prefix's L3
  entries), records the watermark in Redis (`<prefix>invalidated`, a sorted set by time, trimmed
  to the newest `max_events`) and publishes it on the channel `<prefix>invalidations`.
- Every replica process runs an `InvalidationListener` (a thread started with its cache and
  joined at close) subscribed to that channel: it notes the watermark, then sweeps its L1 and L2
  and tells its listeners (the semantic index) which digests it dropped.
- A message sent while a listener was disconnected (Redis restarted, a network blip) is not lost:
  on every (re)connect the listener first subscribes, then reads the watermarks recorded since the
  last one it saw (all of them at start), so it never misses one that Redis still holds.

Matching needs metadata in the entry (`CacheEntry.tags/scope/adapter`). L1 and L2 have no
secondary index: a tag, tenant or adapter sweep decodes every entry of the tier (L2: one read
transaction, see docs/replicas.md for the cost per 10,000 entries); a key needs one delete. The
reads stay correct without the sweep, so its cost is off the request path, on the listener thread.

Times: `at_s` is Redis's clock (`TIME`), `created_s` the generating replica's wall clock; entries
created up to `skew_s` after the watermark are also dropped, to absorb clock skew between hosts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiercache.codec import CacheEntry
from tiercache.errors import InvalidRequest, Unavailable
from tiercache.stores import open_lmdb

if TYPE_CHECKING:
    from tiercache.redis_tier import RedisLink
    from tiercache.stores import Store
    from tiercache.tiered import TieredCache

log = logging.getLogger(__name__)

DEFAULT_SKEW_S = 0.05
DEFAULT_MAX_EVENTS = 100_000


class InvalidationKind(str, Enum):
    KEY = "key"  # one exact-cache digest
    TAG = "tag"  # every entry stored with this cache_control tag
    TENANT = "tenant"  # every entry of a tenant scope (tiercache.keys.tenant_scope)
    ADAPTER = "adapter"  # every entry generated with this adapter digest


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


def checked_digest(value: str, what: str) -> str:
    """A hex SHA-256 digest as keys and adapter versions are written (lower case, no spaces);
    InvalidRequest otherwise, rather than an invalidation that silently matches nothing."""
    digest = value.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise InvalidRequest(f"{what} must be a 64-character hex digest, got {value!r}")
    return digest


def applies(inv: Invalidation, key: str, entry: CacheEntry, skew_s: float = DEFAULT_SKEW_S) -> bool:
    """Whether `inv` kills `entry` (stored under `key`)."""
    if entry.created_s > inv.at_s + skew_s:
        return False
    if inv.kind is InvalidationKind.KEY:
        return key == inv.value
    if inv.kind is InvalidationKind.TAG:
        return inv.value in entry.tags
    if inv.kind is InvalidationKind.TENANT:
        return bool(entry.scope) and entry.scope == inv.value
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
        if entry.scope:
            mark = marks[InvalidationKind.TENANT].get(entry.scope)
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


def sweep(store: Store, inv: Invalidation, skew_s: float = DEFAULT_SKEW_S) -> list[str]:
    """Delete what `inv` kills from `store`; the keys deleted. A key costs one delete; a tag,
    tenant or adapter a scan of the whole store."""
    if inv.kind is InvalidationKind.KEY:
        return [inv.value] if store.delete(inv.value) else []
    victims = [key for key, entry in store.scan() if applies(inv, key, entry, skew_s)]
    if victims:
        store.delete_many(victims)
    return victims


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


DroppedFn = Callable[[Invalidation, list[str]], None]
"""Told which digests a received invalidation dropped locally (for a key: always that digest);
the semantic index forgets their rows."""

ReceivedFn = Callable[[Invalidation, float], None]
"""Told of each message from another process once it is applied (watermark noted, local tiers
swept), with its lag in seconds: from `published_s` (or `at_s` for a message without it) to now
on this cache's clock; clock skew between hosts shows in it, clamped at 0."""


@dataclass(frozen=True, slots=True)
class ListenerStats:
    connected: bool
    received: int  # messages applied from other replicas
    caught_up: int  # watermarks read from Redis on (re)connect
    reconnects: int
    dropped: int  # entries this listener's sweeps deleted
    # By kind (`InvalidationKind.value`; a kind never counted may be absent):
    received_by_kind: dict[str, int] = field(default_factory=dict)  # messages, as `received`
    applied_by_kind: dict[str, int] = field(default_factory=dict)  # news: raised a watermark
    replayed_by_kind: dict[str, int] = field(default_factory=dict)  # news read on a reconnect
    dropped_by_kind: dict[str, int] = field(default_factory=dict)  # entries, as `dropped`


class InvalidationListener:
    """A background thread that applies other replicas' invalidations to one `TieredCache`.

    Subscribes to `<prefix>invalidations` on its own connection; after any error it reconnects
    every `retry_s` and catches up from `<prefix>invalidated`. `close()` stops and joins it
    (at most `poll_s` plus one Redis timeout). `on_dropped` callbacks run on this thread.
    """

    def __init__(
        self,
        link: RedisLink,
        cache: TieredCache,
        poll_s: float = 0.2,
        retry_s: float = 1.0,
        ping_s: float = 5.0,
    ) -> None:
        self.link = link
        self.cache = cache
        self.table = cache.invalidations
        self.channel = link.key("invalidations")
        self.events = link.key("invalidated")
        self._poll_s = poll_s
        self._retry_s = retry_s
        self._ping_s = ping_s
        self._callbacks: list[DroppedFn] = []
        self._received_callbacks: list[ReceivedFn] = []
        self._by_kind: dict[str, Counter[str]] = {
            name: Counter() for name in ("received", "applied", "replayed", "dropped")
        }
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._attempted = threading.Event()  # the first connection attempt ended, either way
        self._lock = threading.Lock()
        self._received = self._caught_up = self._reconnects = self._dropped = 0
        self._thread: threading.Thread | None = None

    def on_dropped(self, callback: DroppedFn) -> None:
        self._callbacks.append(callback)

    def on_received(self, callback: ReceivedFn) -> None:
        self._received_callbacks.append(callback)

    def start(self) -> InvalidationListener:
        self._thread = threading.Thread(target=self._run, name="tiercache-invalidations")
        self._thread.daemon = True  # never keeps a stub process alive; close() joins it
        self._thread.start()
        return self

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def wait_first_attempt(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the first connection attempt to end; True when it
        connected, so that every watermark recorded in Redis is noted (a replica started after
        an invalidation must not serve what its L2 kept). False at once when Redis refused."""
        self._attempted.wait(timeout_s)
        return self._connected.is_set()

    def _run(self) -> None:
        import redis  # only processes with L3 import the client

        errors = (redis.exceptions.RedisError, OSError, ValueError)
        pubsub: Any = None
        first = True
        next_ping = 0.0
        while not self._stop.is_set():
            if pubsub is None:
                try:
                    pubsub = self._connect(catch_up_sweeps=not first)
                except errors as exc:
                    self._disconnected(exc, first)
                    self._attempted.set()
                    self._stop.wait(self._retry_s)
                    continue
                self._attempted.set()
                first = False
                next_ping = time.monotonic() + self._ping_s
            try:
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=self._poll_s)
                if time.monotonic() >= next_ping:  # a dead peer that never closed the socket
                    pubsub.ping()
                    next_ping = time.monotonic() + self._ping_s
            except errors as exc:
                self._close_quietly(pubsub)
                pubsub = None
                self._disconnected(exc, False)
                continue
            if message is None or message.get("type") != "message":
                continue
            try:
                inv = Invalidation.from_json(message["data"])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignored a malformed invalidation message: %s", exc)
                continue
            if inv.origin != self.table.origin:
                news = self.table.note(inv, from_redis=True)
                self._apply(inv, sweep_local=True, noted=True)
                lag_s = max(0.0, self.cache.now() - (inv.published_s or inv.at_s))
                with self._lock:
                    self._received += 1
                    self._by_kind["received"][inv.kind.value] += 1
                    self._by_kind["applied"][inv.kind.value] += news
                for received in self._received_callbacks:
                    try:
                        received(inv, lag_s)
                    except Exception:  # noqa: BLE001 - a listener's hook must not stop the thread
                        log.exception("invalidation callback failed")
        self._close_quietly(pubsub)

    def _connect(self, catch_up_sweeps: bool) -> Any:
        """Subscribe first, then read the watermarks recorded since the newest one seen: an
        invalidation published in between arrives twice, which is harmless."""
        pubsub = self.link.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.channel)
            since = self.table.newest_s - 2 * self.table.skew_s if self.table.newest_s else "-inf"
            rows: Any = self.link.client.zrangebyscore(self.events, since, "+inf", withscores=True)
        except BaseException:
            self._close_quietly(pubsub)
            raise
        for member, score in rows:
            try:
                inv = Invalidation.from_member(member, float(score))
            except ValueError:
                continue
            # At start every recorded watermark is noted; reads check them, so no sweep is
            # needed. After an outage only the news is swept.
            news = self.table.note(inv, from_redis=True)
            if news and catch_up_sweeps:
                self._apply(inv, sweep_local=True, noted=True)
            with self._lock:
                self._caught_up += 1
                self._by_kind["applied"][inv.kind.value] += news
                self._by_kind["replayed"][inv.kind.value] += news and catch_up_sweeps
        if self._connected.is_set() is False:
            log.info("invalidation listener subscribed to %s", self.channel)
        self._connected.set()
        return pubsub

    def _apply(self, inv: Invalidation, sweep_local: bool, noted: bool = False) -> None:
        """Note the watermark (reads are right from here on), then reclaim the space."""
        if not noted:
            self.table.note(inv, from_redis=True)
        if not sweep_local:
            return
        dropped: list[str] = []
        for tier, store in self.cache.local_stores():
            try:
                dropped.extend(sweep(store, inv, self.table.skew_s))
            except Exception:  # noqa: BLE001 - the watermark holds; the thread must go on
                log.exception("sweeping %s for %s %r failed", tier.value, inv.kind.value, inv.value)
        with self._lock:
            self._dropped += len(dropped)  # entries, counted once per tier
            self._by_kind["dropped"][inv.kind.value] += len(dropped)
        digests = list(dict.fromkeys(dropped))
        if inv.kind is InvalidationKind.KEY and inv.value not in digests:
            digests.append(inv.value)  # another process on the host may have swept it first
        for callback in self._callbacks:
            try:
                callback(inv, digests)
            except Exception:  # noqa: BLE001 - a listener's hook must not stop the thread
                log.exception("invalidation callback failed")

    def _disconnected(self, exc: BaseException, first: bool) -> None:
        was_connected = self._connected.is_set()
        self._connected.clear()
        with self._lock:
            self._reconnects += 1
        if was_connected or first:
            log.warning(
                "invalidation listener lost Redis (%s: %s); reconnecting every %.1f s",
                type(exc).__name__,
                exc,
                self._retry_s,
            )

    @staticmethod
    def _close_quietly(pubsub: Any) -> None:
        if pubsub is None:
            return
        try:
            pubsub.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            log.debug("closing a pubsub connection failed", exc_info=True)

    def stats(self) -> ListenerStats:
        with self._lock:
            return ListenerStats(
                self._connected.is_set(),
                self._received,
                self._caught_up,
                self._reconnects,
                self._dropped,
                received_by_kind=dict(self._by_kind["received"]),
                applied_by_kind=dict(self._by_kind["applied"]),
                replayed_by_kind=dict(self._by_kind["replayed"]),
                dropped_by_kind=dict(self._by_kind["dropped"]),
            )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


@dataclass(frozen=True, slots=True)
class InvalidationReport:
    invalidation: Invalidation
    dropped_local: int  # entries this process dropped from its L1 and L2
    dropped_shared: int  # entries deleted from L3
    published: bool  # recorded in Redis and sent to the other replicas


@dataclass(frozen=True, slots=True)
class InvalidatorStats:
    issued_by_kind: dict[str, int]  # invalidations applied here (published or not), by kind
    published: int  # of those, recorded in Redis and sent to the other replicas
    dropped_by_kind: dict[str, int]  # entries deleted here (L1/L2) and from L3, by kind


class Invalidator:
    """The admin side: apply an invalidation here, in L3, and on every other replica.

    Without Redis (`link` None) an invalidation is local to this process and its host's L2. With
    Redis, `at_s` is Redis's clock; if Redis cannot be reached the invalidation is still applied
    here and `Unavailable` is raised, so the caller knows the other replicas did not get it.
    """

    def __init__(
        self,
        cache: TieredCache,
        link: RedisLink | None = None,
        max_events: int = DEFAULT_MAX_EVENTS,
    ) -> None:
        self.cache = cache
        self.link = link
        self.max_events = max_events
        self._lock = threading.Lock()
        self._issued: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()
        self._published = 0

    def invalidate(
        self, kind: InvalidationKind, value: str, sweep_shared: bool = True
    ) -> InvalidationReport:
        """`sweep_shared` False leaves matching L3 entries to expire (they are never served:
        every reader checks the watermark), avoiding a scan of every L3 entry."""
        if not value:
            raise ValueError(f"an invalidation by {kind.value} needs a value")
        table = self.cache.invalidations
        redis_s = self._redis_time()
        at_s = self.cache.now() if redis_s is None else redis_s
        inv = Invalidation(kind, value, at_s, table.origin)
        table.note(inv)
        if self.cache.host_marks is not None:
            try:
                self.cache.host_marks.record(inv)  # the host's other processes, before the sweep
            except Exception:  # noqa: BLE001 - the sweep and Redis still reach what they reach
                log.exception("recording %s in the host's invalidation log failed", inv.member())
        local = 0
        for _, store in self.cache.local_stores():
            local += len(sweep(store, inv, table.skew_s))
        self._count(inv, local, issued=True)
        link = self.link
        if link is None:
            return InvalidationReport(inv, local, 0, False)
        if redis_s is None:
            raise Unavailable(
                f"Redis {link.url or ''} is unavailable: the invalidation of {kind.value} "
                f"{value!r} was applied on this replica only"
            )
        # Record and publish first, then sweep L3: the replicas act at once however long the
        # sweep takes, and the record's score stays close to when it is written (a listener
        # that reconnects catches up from the newest score it has seen).
        shared = 0
        try:
            link.call_or_raise(lambda c: self._record(c, link, inv))
            with self._lock:
                self._published += 1
        finally:  # swept also when publishing failed: what L3 holds is dropped either way
            if self.cache.l3 is not None and (kind is InvalidationKind.KEY or sweep_shared):
                shared = len(sweep(self.cache.l3, inv, table.skew_s))
            self._count(inv, shared)
        return InvalidationReport(inv, local, shared, True)

    def _count(self, inv: Invalidation, dropped: int, issued: bool = False) -> None:
        with self._lock:
            self._issued[inv.kind.value] += issued
            self._dropped[inv.kind.value] += dropped

    def stats(self) -> InvalidatorStats:
        with self._lock:
            return InvalidatorStats(dict(self._issued), self._published, dict(self._dropped))

    def _redis_time(self) -> float | None:
        """Redis's clock (every replica's watermarks on one clock); None without Redis."""
        if self.link is None:
            return None
        found: Any = self.link.call(lambda c: c.time(), None)
        return None if found is None else float(found[0]) + float(found[1]) / 1e6

    def _record(self, client: Any, link: RedisLink, inv: Invalidation) -> None:
        """Record the watermark (for replicas that connect later), then publish it."""
        events = link.key("invalidated")
        pipe = client.pipeline(transaction=False)
        pipe.zadd(events, {inv.member(): inv.at_s}, gt=True)
        pipe.zremrangebyrank(events, 0, -(self.max_events + 1))
        message = replace(inv, published_s=self.cache.now()).to_json()
        pipe.publish(link.key("invalidations"), message)
        pipe.execute()

    def key(self, digest: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.KEY, digest, sweep_shared)

    def tag(self, name: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.TAG, name, sweep_shared)

    def tenant(self, scope: str, sweep_shared: bool = True) -> InvalidationReport:
        """By tenant scope (`tiercache.keys.tenant_scope(secret, tenant)`): every replica shares
        the secret (`tiercache.redis_tier.shared_secret`), so one scope names the tenant there."""
        return self.invalidate(InvalidationKind.TENANT, scope, sweep_shared)

    def adapter(self, digest: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.ADAPTER, digest, sweep_shared)
