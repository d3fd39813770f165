"""L3 on Redis: the exact cache shared by every replica, and the link every Redis user shares.

Redis is an accelerator here, never a dependency: every Redis error becomes a miss, a skipped
write or a `False`, is counted, and is logged once per outage. A `Breaker` keeps a dead Redis
cheap: after a connection failure or a timeout, calls short-circuit (a clock read, well under a
microsecond of work) for `retry_s`, then one call probes Redis again; a success closes the
breaker and L3 is used again. The socket timeout bounds what the first failing call costs.

Layout under the deployment's prefix (`redis_prefix`, default `tiercache:`):
  `<prefix>e:<digest>`   one entry, the checksummed codec bytes (`tiercache.exact.codec`), with a
                         Redis TTL: the entry's remaining TTL, capped by `max_ttl_s`.
  `<prefix>secret`       the server secret every replica adopts (tenant scopes must agree).
  `<prefix>lease:<d>`    cross-replica generation leases (`tiercache.exact.leases`).
  `<prefix>invalidated`  and channel `<prefix>invalidations` (`tiercache.exact.invalidation`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tiercache.errors import Unavailable
from tiercache.exact.codec import CacheEntry, CorruptEntry, decode_entry, encode_entry
from tiercache.exact.stores import StoreStats, read_stored

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "tiercache:"
# Connection failures and timeouts open the breaker; any other Redis error (OOM with a
# noeviction policy, a read-only replica, a wrong type) fails only that call.
_OUTAGE_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_SCAN_BATCH = 500


class Breaker:
    """Closed: calls go to Redis. Open (after a failure): calls are refused until `retry_s`
    has passed, then one call at a time probes. Thread-safe; the clock is injected."""

    def __init__(self, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open = False
        self._next_probe = 0.0
        self.outages = 0

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open

    def allow(self) -> bool:
        """Whether this call may go to Redis. While open, one caller per `retry_s` probes."""
        if not self._open:  # the hot path: no lock while Redis is up
            return True
        with self._lock:
            if not self._open:
                return True
            now = self._clock()
            if now < self._next_probe:
                return False
            self._next_probe = now + self.retry_s
            return True

    def succeeded(self) -> bool:
        """Record a success; True if it ended an outage."""
        if not self._open:
            return False
        with self._lock:
            was_open, self._open = self._open, False
            return was_open

    def failed(self) -> bool:
        """Record an outage error; True if it started an outage (closed -> open)."""
        with self._lock:
            self._next_probe = self._clock() + self.retry_s
            if self._open:
                return False
            self._open = True
            self.outages += 1
            return True


@dataclass(frozen=True, slots=True)
class RedisHealth:
    available: bool  # the breaker is closed
    outages: int  # closed -> open transitions
    errors: int  # calls that failed (outage errors and other Redis errors)
    short_circuits: int  # calls refused while the breaker was open


class RedisLink:
    """One Redis client (a thread-safe connection pool), its breaker and error counters, shared
    by the L3 store, the leases and the invalidation listener of one process.

    `call(fn, default)` runs `fn(client)`; on any Redis error it returns `default`. Nothing is
    raised to a request; `call_or_raise` is for admin operations that must report failure.
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        breaker: Breaker | None = None,
        url: str = "",
        timeout_s: float = 0.25,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.breaker = breaker or Breaker()
        self.url = url
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._errors = 0
        self._short_circuits = 0
        self._other_logged_at = -1e18

    @classmethod
    def from_url(
        cls,
        url: str,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = 0.25,
        retry_s: float = 1.0,
    ) -> RedisLink:
        """A client with short socket timeouts and no retries of its own (the breaker decides
        when to try again). Connecting is lazy: a Redis that is down at start is an outage like
        any other, not a failed start."""
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        return cls(client, prefix, Breaker(retry_s), url=url, timeout_s=timeout_s)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def call(self, fn: Callable[[redis.Redis], T], default: T) -> T:
        if not self.breaker.allow():
            with self._lock:
                self._short_circuits += 1
            return default
        try:
            result = fn(self.client)
        except redis.exceptions.RedisError as exc:
            self._failed(exc)
            return default
        except OSError as exc:
            self._failed(exc)
            return default
        if self.breaker.succeeded():
            log.warning("Redis %s is back; L3, leases and invalidations resume", self._where())
        return result

    def call_or_raise(self, fn: Callable[[redis.Redis], T]) -> T:
        """For admin paths: like `call`, but a refused or failed call raises `Unavailable`."""
        missing = object()
        result: Any = self.call(fn, missing)
        if result is missing:
            raise Unavailable(f"Redis {self._where()} is unavailable")
        return result  # type: ignore[no-any-return]

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self._errors += 1
        if isinstance(exc, _OUTAGE_ERRORS):
            if self.breaker.failed():
                log.warning(
                    "Redis %s is unavailable (%s: %s); serving from local tiers, retrying every "
                    "%.1f s",
                    self._where(),
                    type(exc).__name__,
                    exc,
                    self.breaker.retry_s,
                )
            return
        now = time.monotonic()
        with self._lock:  # other errors: at most one log line per retry interval
            quiet = now - self._other_logged_at < max(self.breaker.retry_s, 1.0)
            if not quiet:
                self._other_logged_at = now
        if not quiet:
            log.warning("Redis %s call failed: %s: %s", self._where(), type(exc).__name__, exc)

    def _where(self) -> str:
        return self.url or "(injected client)"

    def health(self) -> RedisHealth:
        with self._lock:
            return RedisHealth(
                not self.breaker.is_open, self.breaker.outages, self._errors, self._short_circuits
            )

    def close(self) -> None:
        self.client.close()


class RedisStore:
    """L3: exact-cache entries in Redis, shared by every replica (a `tiercache.exact.stores.Store`).

    Values are the same checksummed codec bytes as L2, so a corrupt or foreign value is a counted
    miss and is dropped. Expiry is Redis's: the entry's remaining TTL (an entry already expired
    is not written), capped by `max_ttl_s` (0: no cap; then only Redis's `maxmemory` policy
    bounds L3, so run it with `maxmemory` and `allkeys-lru`).

    `stats()` counts this prefix's entries with SCAN (O(entries) round trips in batches of 500),
    so its result is kept for `stats_max_age_s`; `max_bytes` is the configured budget (Redis's
    own `maxmemory` is the real bound). Evictions are Redis's and are not counted here.
    """

    def __init__(
        self,
        link: RedisLink,
        max_bytes: int = 0,
        max_ttl_s: float = 0.0,
        clock: Callable[[], float] = time.time,
        stats_max_age_s: float = 10.0,
    ) -> None:
        self.link = link
        self._max_bytes = max_bytes
        self._max_ttl_s = max_ttl_s
        self._clock = clock
        self._stats_max_age_s = stats_max_age_s
        self._entry_prefix = link.key("e", "")
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0
        self._counted: tuple[float, int, int] | None = None  # (at, entries, bytes)

    def _key(self, key: str) -> str:
        return self._entry_prefix + key

    def get(self, key: str) -> CacheEntry | None:
        data: Any = self.link.call(lambda c: c.get(self._key(key)), None)
        return read_stored(self, "L3", key, data)

    def put(self, key: str, entry: CacheEntry) -> None:
        ttl_s = self._redis_ttl_s(entry)
        if ttl_s is not None and ttl_s <= 0:
            return  # already expired: never serve it, and do not overwrite a live one with it
        data = encode_entry(entry)
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.link.call(lambda c: c.set(self._key(key), data, px=px), None)

    def _redis_ttl_s(self, entry: CacheEntry) -> float | None:
        """Seconds Redis should keep `entry` (None: no expiry)."""
        remaining = None
        if entry.ttl_s > 0:
            remaining = entry.created_s + entry.ttl_s - self._clock()
        if self._max_ttl_s > 0:
            remaining = self._max_ttl_s if remaining is None else min(remaining, self._max_ttl_s)
        return remaining

    def delete(self, key: str) -> bool:
        removed = bool(self.link.call(lambda c: c.delete(self._key(key)), 0))
        return removed

    def delete_many(self, keys: Iterable[str]) -> int:
        names = [self._key(k) for k in keys]
        removed = 0
        for i in range(0, len(names), _SCAN_BATCH):
            batch = names[i : i + _SCAN_BATCH]
            removed += int(self.link.call(lambda c, b=batch: c.delete(*b), 0))  # type: ignore[misc]
        return removed

    def _names(self) -> Iterator[list[bytes]]:
        """This prefix's entry keys, in batches; stops quietly if Redis fails mid-scan."""
        cursor = 0
        pattern = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self._entry_prefix) + "*"
        while True:
            found = self.link.call(
                lambda c, at=cursor: c.scan(at, match=pattern, count=_SCAN_BATCH),  # type: ignore[misc]
                None,
            )
            if found is None:
                return
            cursor, names = found
            if names:
                yield list(names)
            if cursor == 0:
                return

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        start = len(self._entry_prefix)
        for names in self._names():
            values = self.link.call(lambda c, n=names: c.mget(n), None)  # type: ignore[misc]
            if values is None:
                return
            for name, data in zip(names, values, strict=True):
                if data is None:
                    continue
                try:
                    yield name.decode()[start:], decode_entry(data)
                except CorruptEntry:
                    continue

    def clear(self) -> None:
        for names in self._names():
            self.link.call(lambda c, n=names: c.unlink(*n), 0)  # type: ignore[misc]

    def _count_entries(self) -> tuple[int, int]:
        counted = self._counted
        now = time.monotonic()
        if counted is not None and now - counted[0] < self._stats_max_age_s:
            return counted[1], counted[2]
        entries = total = 0
        for names in self._names():

            def lengths(c: redis.Redis, n: list[bytes] = names) -> list[int]:
                pipe = c.pipeline(transaction=False)
                for name in n:
                    pipe.strlen(name)
                return [int(x) for x in pipe.execute()]

            sizes: list[int] = self.link.call(lengths, [])
            entries += len(sizes)
            total += sum(int(s) for s in sizes)
        self._counted = (now, entries, total)
        return entries, total

    def stats(self) -> StoreStats:
        entries, nbytes = self._count_entries()
        with self._lock:
            return StoreStats(
                entries=entries,
                bytes=nbytes,
                max_bytes=self._max_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=0,
                corrupt=self._corrupt,
            )

    def _count(self, hits: int = 0, misses: int = 0, corrupt: int = 0) -> None:
        with self._lock:
            self._hits += hits
            self._misses += misses
            self._corrupt += corrupt

    def close(self) -> None:
        """Closes the link too: the store owns it (`TieredCache.close` closes the invalidation
        listener first, and `Generations.close` its leases)."""
        self.link.close()


def shared_secret(link: RedisLink, local: bytes) -> bytes:
    """The secret every replica uses for tenant scopes: the one in Redis, or `local` if Redis
    has none yet (set atomically, first replica wins). Cross-replica hits need one secret,
    because the tenant scope is part of every digest. `local` when Redis is unreachable."""
    name = link.key("secret")

    def adopt(c: redis.Redis) -> bytes:
        c.set(name, local, nx=True)
        stored: Any = c.get(name)
        return bytes(stored) if stored else local

    shared = link.call(adopt, local)
    if len(shared) < len(local):
        log.warning("the secret in Redis (%s) is too short; using this host's own", name)
        return local
    return shared
