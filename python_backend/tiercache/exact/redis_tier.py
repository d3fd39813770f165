"""L3 on Redis: the exact cache shared by every replica, and the link every Redis user shares.

Redis is an accelerator here, never a dependency: every Redis error becomes a miss, a skipped
write or a `False`, is counted, and is logged once per outage. A `Breaker` keeps a dead Redis
cheap: after a connection failure or a timeout, calls short-circuit (a clock read, well under a
microsecond of work) for `retry_s`, then one call probes Redis again; a success closes the
breaker and L3 is used again. The socket timeout bounds what the first failing call costs.

Redis is not trusted: whoever can read it must not learn the server secret, and whoever can
write it must not make a replica serve, wipe or resurrect anything. So the secret never goes to
Redis (each replica reads it from a file: `tiercache.stages.parts.load_secret`; Redis holds only
its fingerprint, and a replica whose secret differs refuses to start), and everything a replica
acts on is authenticated by a `Signer`: HMAC-SHA256 under a key derived from the secret for one
purpose (`tiercache.exact.keys.derive_key`), over the Redis key (or channel) it lives under and
the whole value. What does not verify is refused and counted (`RedisHealth.forged`, exported as
`tiercache_redis_forged_total`): an L3 value is a miss (never served, never copied into L2), an
invalidation or a semantic row is ignored. Values written by releases before the signatures (and
their invalidation records and semantic rows) fail the check too: after an upgrade they are
misses, never served, and expire or are overwritten.

Layout under the deployment's prefix (`redis_prefix`, default `tiercache:`):
  `<prefix>e:<digest>`   one entry: `TCA1` | HMAC-SHA256 (32 bytes, "redis values", over the key
                         name and the rest) | the checksummed codec bytes (`tiercache.exact.codec`),
                         with a Redis TTL: the entry's remaining TTL, capped by `max_ttl_s`.
  `<prefix>secret_fingerprint`  hex of `derive_key(secret, "fingerprint")`: which secret the
                         fleet uses, set by the first replica to start (`check_fleet_secret`).
  `<prefix>secret`       only left by an older release (the secret in clear): deleted by the first
                         replica whose secret it is; any other refuses to start.
  `<prefix>lease:<d>`    cross-replica generation leases (`tiercache.exact.leases`).
  `<prefix>invalidated`  and channel `<prefix>invalidations` (`tiercache.exact.invalidation`).

Eviction: L3 entries carry a TTL (when `max_ttl_s` or their own `ttl_s` is set); the control keys
(the fingerprint, the invalidation log, the semantic stream, the adapter hashes) never do, and
leases carry their own short one. So under a `volatile-*` `maxmemory-policy` Redis evicts only
entries (and, rarely, a lease: two replicas then generate one answer), never what correctness
rests on. Under `allkeys-*` it may evict the invalidation log (a replica that was down would
serve what it invalidated) or the fingerprint (a replica with another secret would start):
`check_eviction_policy` refuses that at start.

The Redis password: in `redis_url` (unsafe: the URL is a stage parameter, readable through
Triton's model configuration), or, better, `$TIERCACHE_REDIS_PASSWORD` or a file named by
`$TIERCACHE_REDIS_PASSWORD_FILE`. A link shows its URL only with the password masked
(`redact_url`), in logs and errors alike.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tiercache.errors import ConfigError, Unavailable
from tiercache.exact.codec import CacheEntry, CorruptEntry, decode_entry, encode_entry
from tiercache.exact.keys import (
    REDIS_INVALIDATIONS,
    REDIS_SEMANTIC_ROWS,
    REDIS_VALUES,
    derive_key,
    secret_fingerprint,
)
from tiercache.exact.stores import StoreStats, peeked, read_stored
from tiercache.log_throttle import LogThrottle

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "tiercache:"
PASSWORD_ENV = "TIERCACHE_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "TIERCACHE_REDIS_PASSWORD_FILE"
ALLOW_ALLKEYS_ENV = "TIERCACHE_REDIS_ALLOW_ALLKEYS_EVICTION"  # "1": start under allkeys-* anyway
# The purposes of the keys values in Redis are signed under (`derive_key`); each signer's
# refusals are counted under its purpose (`RedisHealth.forged`).
SIGNED = (REDIS_VALUES, REDIS_INVALIDATIONS, REDIS_SEMANTIC_ROWS)
SEALED = b"TCA1"  # the magic of a signed L3 value
TAG_BYTES = 32  # an HMAC-SHA256
_LENGTH = struct.Struct(">Q")
_FORGED_LOG_S = 60.0  # at most one warning per signer this often: a forger must not flood logs
# Connection failures and timeouts open the breaker; any other Redis error (OOM with a
# noeviction policy, a read-only replica, a wrong type) fails only that call.
_OUTAGE_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_SCAN_BATCH = 500
# The longest entry name a replica writes past the prefix (a hex digest; room to spare): SCAN's
# names are filtered by length inside Redis (`_SCAN_NAMES`), so a name planted hundreds of MB
# long never reaches a process.
MAX_ENTRY_NAME_CHARS = 256
# The entries one count for the metrics reads at most: millions of keys planted under the
# entries' prefix cost a count this many names, not their number.
MAX_COUNTED_NAMES = 1_000_000
# What a log line shows of a name found in Redis (anyone who can write Redis chooses it)
_LOGGED_NAME_CHARS = 80
_COUNT_CUT_LOG = LogThrottle()  # a count stopped at MAX_COUNTED_NAMES: said once a minute
_UNREADY_LOG = LogThrottle()  # L3 not read before the listener caught up: said once a minute
# The secret's fingerprint and an older release's secret are read at most this long at start
_SHORT_READ = 256
# An L3 value is read at most this long (GETRANGE): a longer one was never written by a replica
# (`RedisStore.put` does not share one) and is refused as forged, so a huge value planted in
# Redis costs a reader this much memory, not its size. An answer of the 1,024-token limit takes a
# few KiB.
MAX_VALUE_BYTES = 4 << 20


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


def redact_url(url: str) -> str:
    """`url` as it may be logged or put in an error: its password (in the user part or a
    `password=` query parameter) replaced by `***` (`redis://user:***@host:6379/0`)."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL we can take apart: show none of it
        return "(a redis_url that does not parse)"
    if "@" in url and "@" not in parts.netloc:
        # an unescaped "#", "/" or "?" in the password ends the host part before its "@": the
        # parts hold pieces of the password, so none of the URL can be shown
        return "(a redis_url that does not parse)"
    netloc = parts.netloc
    if password is not None:
        user = parts.username or ""
        netloc = f"{user}:***@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(name == "password" for name, _ in pairs):
            masked = [(n, "***" if n == "password" else v) for n, v in pairs]
            query = urlencode(masked, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def url_has_password(url: str) -> bool:
    """Whether `url` carries a password itself (user part or `password=` query parameter)."""
    try:
        parts = urlsplit(url)
        in_user = parts.password is not None
    except ValueError:
        return False
    return in_user or any(n == "password" for n, _ in parse_qsl(parts.query))


def redis_password(environ: Mapping[str, str]) -> str | None:
    """The Redis password from the environment: `$TIERCACHE_REDIS_PASSWORD`, or the contents of
    the file `$TIERCACHE_REDIS_PASSWORD_FILE` names (one trailing newline dropped); None when
    neither is set. ConfigError for both at once, or a file that cannot be read or is empty."""
    value = environ.get(PASSWORD_ENV, "")
    named = environ.get(PASSWORD_FILE_ENV, "")
    if value and named:
        raise ConfigError(f"set ${PASSWORD_ENV} or ${PASSWORD_FILE_ENV}, not both")
    if named:
        try:
            value = Path(named).read_text(encoding="utf-8").removesuffix("\n").removesuffix("\r")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"${PASSWORD_FILE_ENV} names {named}, which cannot be read: {exc}"
            ) from exc
        if not value:
            raise ConfigError(f"${PASSWORD_FILE_ENV} names {named}, which is empty")
    return value or None


class Signer:
    """HMAC-SHA256 under the key derived from a secret for one purpose (`derive_key`), over the
    name a value lives under in Redis (key or channel) and the value, as length-prefixed parts:
    a value is valid only under its own name (a copy under another key is refused) and only for
    its purpose. Thread-safe. Counts what it refuses (`refused`) and logs it, at most one line
    per minute (a forger must not flood the log).

    Costs one HMAC over the value: the keyed state is computed once and copied per call
    (checking a 2 KB value took 7-9 us on the shared 2-core dev VM, half of decoding it, and
    well under one Redis round trip; L1 and L2 hits are not signed and pay nothing).
    """

    __slots__ = ("purpose", "_mac", "_lock", "_refused", "_logged_at", "_clock")

    def __init__(
        self, secret: bytes, purpose: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.purpose = purpose
        self._mac = hmac.new(derive_key(secret, purpose), digestmod=hashlib.sha256)
        self._lock = threading.Lock()
        self._refused = 0
        self._logged_at = -1e18
        self._clock = clock

    def tag(self, name: str, *parts: bytes) -> bytes:
        """The 32-byte tag of `parts` stored under `name`."""
        mac = self._mac.copy()
        for part in (name.encode("utf-8"), *parts):
            mac.update(_LENGTH.pack(len(part)))
            mac.update(part)
        return mac.digest()

    def verify(self, tag: bytes, name: str, *parts: bytes) -> bool:
        """Whether `tag` is the tag of `parts` under `name` (constant time); a refusal counts."""
        if hmac.compare_digest(tag, self.tag(name, *parts)):
            return True
        self.refuse(name)
        return False

    def seal(self, name: str, data: bytes) -> bytes:
        """`data` as stored under `name`: `TCA1` | tag | data."""
        return SEALED + self.tag(name, data) + data

    def unseal(self, name: str, stored: bytes, count: bool = True) -> bytes | None:
        """The data of a value `seal` made for `name`; None for anything else (counted unless
        `count` is False: a background read that a request's read will count)."""
        head = len(SEALED) + TAG_BYTES
        data = stored[head:]
        if (
            len(stored) >= head
            and stored[: len(SEALED)] == SEALED
            and hmac.compare_digest(stored[len(SEALED) : head], self.tag(name, data))
        ):
            return data
        if count:
            self.refuse(name)
        return None

    def refuse(self, name: str) -> None:
        """Count one value under `name` that is not ours (and log, at most once a minute)."""
        now = self._clock()
        with self._lock:
            self._refused += 1
            count = self._refused
            quiet = now - self._logged_at < _FORGED_LOG_S
            if not quiet:
                self._logged_at = now
        if not quiet:
            log.warning(
                "refused %s in Redis that this fleet's secret did not sign (%s; %d so far): "
                "written by someone without the secret, or by an older release",
                self.purpose,
                logged_name(name),
                count,
            )

    @property
    def refused(self) -> int:
        with self._lock:
            return self._refused


@dataclass(frozen=True, slots=True)
class RedisHealth:
    available: bool  # the breaker is closed
    outages: int  # closed -> open transitions
    errors: int  # calls that failed (outage errors and other Redis errors)
    short_circuits: int  # calls refused while the breaker was open
    # Values refused because their signature did not verify, by purpose (`SIGNED`).
    forged: dict[str, int] = field(default_factory=dict)


class RedisLink:
    """One Redis client (a thread-safe connection pool), its breaker and error counters, shared
    by the L3 store, the leases and the invalidation listener of one process, and the fleet's
    secret, which its users sign and verify what they keep in Redis under (`signer`).

    `call(fn, default)` runs `fn(client)`; on any Redis error it returns `default`. Nothing is
    raised to a request; `call_or_raise` is for admin operations that must report failure.

    `secret` None: a random one, this link's alone: what its users write only they can read back,
    and nothing another process wrote verifies (a tool or test that shares nothing; a replica
    always passes the fleet's). `url` is kept only with its password masked (`redact_url`).
    """

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = DEFAULT_PREFIX,
        breaker: Breaker | None = None,
        url: str = "",
        timeout_s: float = 0.25,
        secret: bytes | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.breaker = breaker or Breaker()
        self.url = redact_url(url) if url else ""
        self.timeout_s = timeout_s
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self._signers: dict[str, Signer] = {}
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
        *,
        secret: bytes | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> RedisLink:
        """A client with short socket timeouts and no retries of its own (the breaker decides
        when to try again). Connecting is lazy: a Redis that is down at start is an outage like
        any other, not a failed start. The password comes from `url` or from the environment
        (`redis_password`; `environ` None: the process's), never from both (ConfigError)."""
        password = redis_password(os.environ if environ is None else environ)
        extra: dict[str, Any] = {}
        if password is not None:
            if url_has_password(url):
                raise ConfigError(
                    f"the Redis password is given twice, in redis_url ({redact_url(url)}) and "
                    f"in ${PASSWORD_ENV} or ${PASSWORD_FILE_ENV}: drop it from redis_url (the "
                    "URL is readable through Triton's model configuration)"
                )
            extra["password"] = password
        client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            **extra,
        )
        return cls(client, prefix, Breaker(retry_s), url=url, timeout_s=timeout_s, secret=secret)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def signer(self, purpose: str) -> Signer:
        """The signer for `purpose` (one of `SIGNED`) under this link's secret, one per link,
        so its refusals add up in `health().forged`."""
        if purpose not in SIGNED:
            raise ValueError(f"unknown signing purpose {purpose!r}; one of {SIGNED}")
        with self._lock:
            found = self._signers.get(purpose)
            if found is None:
                found = self._signers[purpose] = Signer(self._secret, purpose)
            return found

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
            signers = list(self._signers.values())
            errors, short_circuits = self._errors, self._short_circuits
        return RedisHealth(
            not self.breaker.is_open,
            self.breaker.outages,
            errors,
            short_circuits,
            forged={s.purpose: s.refused for s in signers},
        )

    def close(self) -> None:
        self.client.close()


# Deletes a key only while its value's SHA-1 is the one given (a value written since is left).
_DELETE_IF_SAME = """
local value = redis.call('GET', KEYS[1])
if value and redis.sha1hex(value) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# `_DELETE_IF_SAME` for a batch: KEYS[i] is deleted only while its value is ARGV[2i] bytes
# long (checked by STRLEN first, so a value rewritten to another length is never read) and its
# SHA-1 is ARGV[2i - 1]; the reply is a 1 or 0 per key, in order. The caller bounds a call's
# bytes (MAX_BATCH_BYTES).
_DELETE_EACH_IF_SAME = """
local out = {}
for i, name in ipairs(KEYS) do
  out[i] = 0
  local n = redis.pcall('STRLEN', name)
  if type(n) == 'number' and n > 0 and n == tonumber(ARGV[2 * i]) then
    local value = redis.call('GET', name)
    if redis.sha1hex(value) == ARGV[2 * i - 1] then out[i] = redis.call('DEL', name) end
  end
end
return out
"""

# Sets KEYS[1] to ARGV[2] (for ARGV[3] milliseconds; "": no expiry) only while it holds what
# the caller read: ARGV[1] "" for nothing readable (no key, an empty string, or not a string:
# `bounded_get` reads those as none), else the SHA-1 of its first ARGV[4] bytes (what
# `bounded_get` reads); 1 if set, 0 when another writer came in between.
_SET_IF_SAME = """
local kind = redis.call('TYPE', KEYS[1]).ok
local seen = ''
if kind == 'string' and redis.call('STRLEN', KEYS[1]) > 0 then
  seen = redis.sha1hex(redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[4]) - 1))
end
if seen ~= ARGV[1] then return 0 end
if ARGV[3] == '' then redis.call('SET', KEYS[1], ARGV[2])
else redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) end
return 1
"""
MERGE_ATTEMPTS = 8  # compare-and-set tries of one merge before it gives up (Unavailable)
_READ_BYTES = str(MAX_VALUE_BYTES + 1)  # what `bounded_get` reads of a value


def _scripts_refused(exc: redis.exceptions.ResponseError) -> bool:
    """Whether Redis refused to run a script at all (an ACL without @scripting, EVAL renamed
    away), as opposed to failing one it ran (out of memory, a read-only replica)."""
    text = str(exc)
    return isinstance(exc, redis.exceptions.NoPermissionError) or text.startswith(
        ("NOPERM", "unknown command", "ERR unknown command")
    )


_SCRIPTS_LOG = LogThrottle()  # a Redis that refuses scripts: said once a minute
SCRIPTS_RETRY_S = 60.0  # after a refused merge script, merges use transactions this long


def _by_bytes(items: list[tuple[str, bytes]], most: int) -> Iterator[list[tuple[str, bytes]]]:
    """`items` in runs whose values add up to at most `most` bytes (at least one item each)."""
    run: list[tuple[str, bytes]] = []
    size = 0
    for item in items:
        if run and size + len(item[1]) > most:
            yield run
            run, size = [], 0
        run.append(item)
        size += len(item[1])
    if run:
        yield run


def logged_name(name: str) -> str:
    """A name read from Redis as a log line may show it: its repr (no line breaks), cut."""
    shown = repr(name[: _LOGGED_NAME_CHARS + 1])
    return shown if len(name) <= _LOGGED_NAME_CHARS else shown + " (cut)"


# One SCAN page, its names filtered by length inside Redis: [cursor, names kept, names dropped]
_SCAN_NAMES = """
local page = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', ARGV[3])
local limit = tonumber(ARGV[4])
local kept = {}
local dropped = 0
for _, name in ipairs(page[2]) do
  if string.len(name) <= limit then
    kept[#kept + 1] = name
  else
    dropped = dropped + 1
  end
end
return {page[1], kept, dropped}
"""


def _set_if_same_watched(
    client: redis.Redis, name: str, stored: bytes | None, data: bytes, px: str
) -> int:
    """`_SET_IF_SAME` without a script, for a Redis whose ACL refuses them: `name` set to
    `data` (expiring in `px` ms, "" for never) only while it still reads as `stored`, as
    `bounded_get` reads (WATCH, read, MULTI, SET, EXEC); 1 when set, 0 when it had changed.
    Unavailable when transactions are refused too: nothing is written."""
    try:
        with client.pipeline(transaction=True) as pipe:
            pipe.watch(name)
            if bounded_get(pipe, name) != stored:
                return 0
            pipe.multi()
            pipe.set(name, data, px=int(px) if px else None)
            pipe.execute()
            return 1
    except redis.exceptions.WatchError:
        return 0  # another writer since the read: read and made again
    except redis.exceptions.ResponseError as exc:
        if not _scripts_refused(exc):
            raise
        raise Unavailable(
            f"Redis refuses both scripts and transactions ({exc}): L3's records are not "
            "merged (a plain write could revert another replica's change); allow @scripting "
            "or @transaction to this user"
        ) from exc


def bounded_get(client: Any, name: str) -> bytes | None:
    """The value of `name`, read at most MAX_VALUE_BYTES + 1 bytes long (a longer one shows as
    that long, and is refused); None when there is none (no L3 value is ever empty: each has a
    signed header)."""
    try:
        found: Any = client.getrange(name, 0, MAX_VALUE_BYTES)
    except redis.exceptions.ResponseError as exc:
        if str(exc).startswith("WRONGTYPE"):  # not a string: nothing this fleet wrote, a miss
            return None
        raise
    return bytes(found) if isinstance(found, bytes) and found else None


# The values of KEYS in order, for a scan: each string at most ARGV[1] bytes long (a longer one
# comes as the integer -1, never read; what is not a string, or absent, as nil), and the reply
# at most ARGV[2] bytes: it ends before the value that would pass that, so the caller reads
# the rest in another call. Sized inside Redis, so a batch of values planted at 4 MiB each
# costs the reader at most ARGV[2] bytes a call, not the batch's size.
_BOUNDED_VALUES = """
local out = {}
local total = 0
for i, name in ipairs(KEYS) do
  local n = redis.pcall('STRLEN', name)
  if type(n) ~= 'number' or n == 0 then
    out[i] = false
  elseif n > tonumber(ARGV[1]) then
    out[i] = -1
  else
    if i > 1 and total + n > tonumber(ARGV[2]) then return out end
    total = total + n
    out[i] = redis.call('GET', name)
  end
end
return out
"""
# The most bytes of values one call of `bounded_mget` reads (at least one value is read)
MAX_BATCH_BYTES = 8 << 20
OVERSIZED = b""  # bounded_mget's marker for a value over MAX_VALUE_BYTES (refused as forged)


def bounded_mget(client: Any, names: list[bytes]) -> list[bytes | None]:
    """The value of every name, as `bounded_get` reads one (None: absent or not a string;
    OVERSIZED: longer than MAX_VALUE_BYTES, not read), in as few round trips as the byte bound
    allows (MAX_BATCH_BYTES a call)."""
    found: list[bytes | None] = []
    while len(found) < len(names):
        rest = names[len(found) :]
        reply: Any = client.eval(
            _BOUNDED_VALUES, len(rest), *rest, MAX_VALUE_BYTES, MAX_BATCH_BYTES
        )
        if not reply:  # never for a non-empty batch (its first value is always read)
            raise RuntimeError("Redis returned no values for a batch")
        for value in reply:
            if isinstance(value, bytes):
                found.append(value or None)
            elif value == -1:
                found.append(OVERSIZED)
            else:
                found.append(None)
    return found


class RedisStore:
    """L3: exact-cache entries in Redis, shared by every replica (a `tiercache.exact.stores.Store`).

    Values are the same checksummed codec bytes as L2, signed under the link's secret for
    `REDIS_VALUES`, bound to their key name (`Signer.seal`; the header is inside what is signed).
    A value whose signature does not verify (forged, another fleet's, an older release's) is a
    miss counted in `forged` and is never served or copied to another tier; it is left in Redis:
    the miss's answer overwrites it on write-back, deleting it would put a write on the read path
    that could race that write-back, and whoever wrote it can write it again anyway. A signed
    value that does not decode (damaged) is a counted `corrupt` miss and is dropped.

    Expiry is Redis's: the entry's remaining TTL (an entry already expired is not written),
    capped by `max_ttl_s` (0: no cap). Every entry written has a TTL whenever `max_ttl_s` > 0
    or its own `ttl_s` > 0, which is what lets a `volatile-lru` Redis evict entries and never
    the control keys (`check_eviction_policy`).

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
        self._signer = link.signer(REDIS_VALUES)
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0
        self._counted: tuple[float, int, int] | None = None  # (at, entries, bytes)
        self.long_names = 0  # entry names longer than any a replica writes, left unread
        # monotonic time until which merges skip the script Redis refused (asked again after)
        self._scripts_off_until = 0.0
        # Whether this process has every watermark Redis's invalidation record holds (the
        # listener's catch-up, `open_exact_cache`): until then nothing is read from here, so a
        # value replayed after an invalidation this process has not heard is never served
        self.ready: Callable[[], bool] = lambda: True
        self.unready_reads = 0  # reads refused while not ready

    def _key(self, key: str) -> str:
        return self._entry_prefix + key

    @property
    def forged(self) -> int:
        """Values refused because their signature did not verify (on this link, all stores)."""
        return self._signer.refused

    def get(self, key: str) -> CacheEntry | None:
        if not self._ready():
            self._count(misses=1)
            return None
        name = self._key(key)
        return self._read(key, name, self.link.call(lambda c: bounded_get(c, name), None))

    def _ready(self) -> bool:
        if self.ready():
            return True
        with self._lock:
            self.unready_reads += 1
        if _UNREADY_LOG.ready():
            log.warning(
                "L3 (%s) not read: this process's invalidation listener has not caught up on "
                "Redis's record (starting, cut off, or the record unreadable); its reads are "
                "misses until it has (%d such reads; %d lines not logged)",
                self.link.url or "(injected client)",
                self.unready_reads,
                _UNREADY_LOG.suppressed,
            )
        return False

    def _read(self, key: str, name: str, stored: Any) -> CacheEntry | None:
        """A request's read of what Redis returned for `key` (counted; a corrupt one dropped;
        a forged one, or one longer than MAX_VALUE_BYTES, a counted miss)."""
        if stored is None:
            return read_stored(self, "L3", key, None)
        data = self._unseal(name, stored)
        if data is None:
            self._count(misses=1)
            return None
        return read_stored(self, "L3", key, data)

    def peek(self, key: str) -> CacheEntry | None:
        """The stored entry, read as no request does: nothing counted, a corrupt or forged
        value left alone (a request's `get` drops it), and None at once while the breaker is
        open (never its probe): for background comparisons (an L1 copy's verdicts)."""
        if self.link.breaker.is_open or not self._ready():
            return None
        name = self._key(key)
        stored: Any = self.link.call(lambda c: bounded_get(c, name), None)
        return None if stored is None else peeked(self._unseal(name, stored, count=False))

    def get_or_raise(self, key: str) -> CacheEntry | None:
        """`get` for a read whose caller writes back what it read (a merge): Unavailable when
        Redis could not be asked, where `get` says None (a miss); so too while not `ready`."""
        if not self._ready():
            raise Unavailable(
                "L3 is not read until this process has caught up on Redis's invalidation record"
            )
        name = self._key(key)
        return self._read(key, name, self.link.call_or_raise(lambda c: bounded_get(c, name)))

    def _unseal(self, name: str, stored: bytes, count: bool = True) -> bytes | None:
        """The value's payload, or None (counted as forged unless `count` is False) for one
        whose signature does not verify or that is longer than MAX_VALUE_BYTES (read no
        further)."""
        if len(stored) > MAX_VALUE_BYTES:
            if count:
                self._signer.refuse(name)
            return None
        return self._signer.unseal(name, stored, count)

    def put(self, key: str, entry: CacheEntry) -> None:
        ttl_s = self._redis_ttl_s(entry)
        if ttl_s is not None and ttl_s <= 0:
            return  # already expired: never serve it, and do not overwrite a live one with it
        name = self._key(key)
        data = self._signer.seal(name, encode_entry(entry))
        if len(data) > MAX_VALUE_BYTES:  # readers would refuse it: kept in L1 and L2 only
            log.warning("an entry of %d bytes is not shared through Redis (%d at most)",
                        len(data), MAX_VALUE_BYTES)  # fmt: skip
            return
        px = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.link.call(lambda c: c.set(name, data, px=px), None)

    def merge(
        self,
        key: str,
        make: Callable[[CacheEntry | None], CacheEntry | None],
        attempts: int = MERGE_ATTEMPTS,
    ) -> bool:
        """Write what `make` makes of `key`'s entry (None: absent, unreadable or forged) only
        while Redis still holds what was read (a compare-and-set by script, `_SET_IF_SAME`),
        read and made again when another replica wrote in between, at most `attempts` times
        (then Unavailable); False, writing nothing, when `make` says None. Unavailable when
        Redis cannot be asked. A Redis that refuses scripts (an ACL without @scripting) gets
        the same compare-and-set by a transaction (WATCH, MULTI, EXEC); one that refuses both
        gets nothing written (Unavailable): a plain write could revert another replica's
        change made in between (a lower floor over a higher one, an endorsement over an
        answer generated again). A refused script is not asked again for SCRIPTS_RETRY_S:
        merges in between go straight to the transaction (one round trip fewer each)."""
        name = self._key(key)
        for _ in range(attempts):
            stored = self.link.call_or_raise(lambda c: bounded_get(c, name))
            held = None if stored is None else peeked(self._unseal(name, stored, count=False))
            entry = make(held)
            if entry is None:
                return False
            ttl_s = self._redis_ttl_s(entry)
            if ttl_s is not None and ttl_s <= 0:
                return False  # already expired: never written, as `put`
            data = self._signer.seal(name, encode_entry(entry))
            if len(data) > MAX_VALUE_BYTES:
                log.warning("a record of %d bytes is not shared through Redis (%d at most)",
                            len(data), MAX_VALUE_BYTES)  # fmt: skip
                return False
            seen = "" if stored is None else hashlib.sha1(stored, usedforsecurity=False).hexdigest()
            px = "" if ttl_s is None else str(max(1, int(ttl_s * 1000)))

            def swap(
                c: redis.Redis,
                seen: str = seen,
                stored: bytes | None = stored,
                data: bytes = data,
                px: str = px,
            ) -> int:
                if time.monotonic() < self._scripts_off_until:
                    return _set_if_same_watched(c, name, stored, data, px)
                try:
                    return int(c.eval(_SET_IF_SAME, 1, name, seen, data, px, _READ_BYTES))
                except redis.exceptions.ResponseError as exc:
                    if not _scripts_refused(exc):
                        raise  # OOM, BUSY, READONLY...: a failed write, not a refused script
                    self._scripts_off_until = time.monotonic() + SCRIPTS_RETRY_S
                    if _SCRIPTS_LOG.ready():
                        log.warning(
                            "Redis refused a merge's script (%s): compared and set by a "
                            "transaction instead",
                            exc,
                        )
                return _set_if_same_watched(c, name, stored, data, px)

            if self.link.call_or_raise(swap):
                return True
        raise Unavailable(f"L3's {logged_name(name)} kept changing: {attempts} merges lost")

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

    def delete_if_same(self, key: str, seen: CacheEntry | None) -> bool:
        """Read, compared here (unsealed and decoded), then deleted by a script only while
        Redis still holds those very bytes (compared by SHA-1: the value does not travel
        back). A value that does not verify is never deleted this way (`get` counts it forged
        and leaves it). A Redis that refuses scripts (an ACL without @scripting) leaves the
        entry, logged; its TTL still ends it."""
        name = self._key(key)
        stored: Any = self.link.call(lambda c: bounded_get(c, name), None)
        if stored is None:
            return False
        data = self._unseal(name, stored, count=False)
        if data is None or peeked(data) != seen:
            return False
        same = hashlib.sha1(stored, usedforsecurity=False).hexdigest()
        return bool(self.link.call(lambda c: c.eval(_DELETE_IF_SAME, 1, name, same), 0))

    def delete_many(self, keys: Iterable[str]) -> int:
        names = [self._key(k) for k in keys]
        removed = 0
        for i in range(0, len(names), _SCAN_BATCH):
            batch = names[i : i + _SCAN_BATCH]
            removed += int(self.link.call(lambda c, b=batch: c.delete(*b), 0))  # type: ignore[misc]
        return removed

    def delete_unchanged(self, found: list[tuple[str, CacheEntry]]) -> list[str]:
        """`delete_if_same` for each, a batch of `_SCAN_BATCH` keys at a time: their values
        read (`bounded_mget`) and compared here, then one script deletes those whose bytes
        Redis still holds (a plain DEL deleted what other replicas wrote between the scan and
        the delete). Two round trips a batch, where each key cost two (more where a batch's
        values pass MAX_BATCH_BYTES: the script reads at most that much a call); a batch Redis
        fails stops the rest (nothing more deleted, the sweep's count says so)."""
        removed: list[str] = []
        for i in range(0, len(found), _SCAN_BATCH):
            batch = found[i : i + _SCAN_BATCH]
            names = [self._key(key) for key, _ in batch]
            encoded = [name.encode() for name in names]
            values = self.link.call(lambda c, n=encoded: bounded_mget(c, n), None)  # type: ignore[misc]
            if values is None:
                break
            unchanged: list[tuple[str, bytes]] = []
            for (key, seen), name, stored in zip(batch, names, values, strict=True):
                if not stored:  # absent, or OVERSIZED (never written by a replica)
                    continue
                data = self._unseal(name, stored, count=False)
                if data is not None and peeked(data) == seen:
                    unchanged.append((key, stored))
            for part in _by_bytes(unchanged, MAX_BATCH_BYTES):
                doomed = [self._key(key) for key, _ in part]
                checks: list[str | int] = []
                for _, stored in part:
                    checks += [hashlib.sha1(stored, usedforsecurity=False).hexdigest(), len(stored)]
                reply: Any = self.link.call(
                    lambda c, k=doomed, a=checks: c.eval(  # type: ignore[misc]
                        _DELETE_EACH_IF_SAME, len(k), *k, *a
                    ),
                    None,
                )
                if reply is None:
                    return removed
                removed += [key for (key, _), gone in zip(part, reply, strict=True) if int(gone)]
        return removed

    def _names(self, strict: bool = False) -> Iterator[list[bytes]]:
        """This prefix's entry keys, in batches; stops quietly if Redis fails mid-scan (`strict`:
        raises Unavailable instead, for an operator's call that must say it). A name longer
        than any a replica writes is left in Redis unread (`_SCAN_NAMES`), and counted in
        `long_names`."""
        cursor = 0
        pattern = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self._entry_prefix) + "*"
        limit = len(self._entry_prefix.encode("utf-8")) + MAX_ENTRY_NAME_CHARS
        refused: list[BaseException] = []

        def scan(c: redis.Redis, at: int) -> Any:
            try:
                return c.eval(_SCAN_NAMES, 0, at, pattern, _SCAN_BATCH, limit)
            except redis.exceptions.ResponseError as exc:
                if strict and _scripts_refused(exc):
                    refused.append(exc)
                    return None
                raise

        while True:
            found = self.link.call(lambda c, at=cursor: scan(c, at), None)  # type: ignore[misc]
            if found is None:
                if refused:
                    raise Unavailable(
                        f"Redis refuses scripts ({refused[0]}): tiercache scans L3 with one; "
                        "give this user @scripting, or clear the prefix in Redis itself"
                    )
                if strict:
                    raise Unavailable(f"Redis {self.link.url or ''} failed during a scan".strip())
                return
            cursor, names, dropped = int(found[0]), found[1], int(found[2])
            if dropped:
                with self._lock:
                    self.long_names += dropped
            if names:
                yield [bytes(name) for name in names]
            if cursor == 0:
                return

    def scan(self) -> Iterator[tuple[str, CacheEntry]]:
        start = len(self._entry_prefix)
        for names in self._names():
            values = self.link.call(lambda c, n=names: bounded_mget(c, n), None)  # type: ignore[misc]
            if values is None:
                return
            for raw, stored in zip(names, values, strict=True):
                if stored is None:
                    continue
                if stored is OVERSIZED:  # over MAX_VALUE_BYTES: refused unread, as a get does
                    self._signer.refuse(raw.decode("utf-8", "replace"))
                    continue
                try:
                    name = raw.decode()
                except UnicodeDecodeError:  # never a name this fleet writes (prefix, hex digest)
                    continue
                data = self._unseal(name, stored)  # forged or oversized: skipped (and counted)
                if data is None:
                    continue
                try:
                    yield name[start:], decode_entry(data)
                except CorruptEntry:
                    continue

    def clear(self) -> None:
        """Delete every entry of this prefix; Unavailable when Redis cannot be asked or fails
        part way (what was deleted by then stays deleted: send it again)."""
        for names in self._names(strict=True):
            self.link.call_or_raise(lambda c, n=names: c.unlink(*n))  # type: ignore[misc]

    def _count_entries(self) -> tuple[int, int]:
        counted = self._counted
        now = time.monotonic()
        if counted is not None and now - counted[0] < self._stats_max_age_s:
            return counted[1], counted[2]
        entries = total = read = 0
        for names in self._names():
            read += len(names)
            if read > MAX_COUNTED_NAMES:  # names planted by the million: a lower bound
                if _COUNT_CUT_LOG.ready():
                    log.warning(
                        "L3's entry count stopped at %d names under %s (MAX_COUNTED_NAMES): "
                        "the metrics show a lower bound",
                        MAX_COUNTED_NAMES,
                        logged_name(self._entry_prefix),
                    )
                break

            def lengths(c: redis.Redis, n: list[bytes] = names) -> list[int]:
                pipe = c.pipeline(transaction=False)
                for name in n:
                    pipe.strlen(name)
                return [int(x) for x in pipe.execute()]

            sizes: list[int] = self.link.call(lengths, [])
            entries += len(sizes)
            total += sum(int(s) for s in sizes)
        # stamped when it ended: a count that took longer than the interval is not begun again
        # at once
        self._counted = (time.monotonic(), entries, total)
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


def check_fleet_secret(link: RedisLink, secret: bytes, source: str, register: bool = True) -> bool:
    """Check that `secret` (read from `source`, named in errors) is the fleet's: Redis keeps only
    its fingerprint (`<prefix>secret_fingerprint`, set by the first replica to start, SET NX),
    never the secret. ConfigError, saying how to give this replica the fleet's secret, when the
    fingerprint differs, or when an older release's clear `<prefix>secret` holds another secret
    (never adopted: whoever can write Redis would choose every replica's secret). That legacy key
    holding this secret is deleted (the fingerprint takes its place). True once checked; False
    when Redis could not be asked (warned: the replica starts, and what another fleet's replicas
    wrote would be refused as forged). `register` False (an admin tool, not a replica) only
    reads: no fingerprint is set where none is (it would make its secret the fleet's, and lock
    the replicas out when it is not theirs), and the legacy key is left as it is."""
    fingerprint = secret_fingerprint(secret).encode("ascii")
    fingerprint_key = link.key("secret_fingerprint")
    legacy_key = link.key("secret")

    def short(c: redis.Redis, name: str) -> bytes | None:
        # at most _SHORT_READ bytes (GETRANGE): whatever was planted there, a starting stage
        # reads no more; None when absent (or empty)
        found: Any = c.getrange(name, 0, _SHORT_READ - 1)
        return bytes(found) or None

    def check(c: redis.Redis) -> tuple[str, bytes | None]:
        try:
            return checked(c)
        except redis.exceptions.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            return "wrongtype", None

    def checked(c: redis.Redis) -> tuple[str, bytes | None]:
        legacy = short(c, legacy_key)
        if not register:
            if legacy is not None and not hmac.compare_digest(legacy, secret):
                return "legacy", None
            return "fingerprint", short(c, fingerprint_key)
        if legacy is not None:
            if not hmac.compare_digest(legacy, secret):
                return "legacy", None
            c.set(fingerprint_key, fingerprint, nx=True)
            c.delete(legacy_key)
            log.warning(
                "deleted %s from Redis %s: the server secret in clear text, as an older release "
                "kept it; the fleet's fingerprint is in %s",
                legacy_key,
                link.url or "(injected client)",
                fingerprint_key,
            )
        c.set(fingerprint_key, fingerprint, nx=True)
        return "fingerprint", short(c, fingerprint_key)

    found = link.call(check, None)
    where = link.url or "(injected client)"
    if found is None:
        log.warning(
            "Redis %s did not answer: this replica's secret (%s) is not checked against the "
            "fleet's fingerprint; with another secret, what it reads from Redis is refused as "
            "forged and what it writes there is refused by the others",
            where,
            source,
        )
        return False
    outcome, stored = found
    copy_hint = (
        "copy the secret file of a replica of the fleet (<state>/secret, 0600) over "
        f"{source}, or point $TIERCACHE_SECRET_FILE at a file holding it"
    )
    if outcome == "wrongtype":
        raise ConfigError(
            f"Redis {where} holds a value of another type than a string in {fingerprint_key} "
            f"or {legacy_key} (planted, or written by something else sharing the prefix): this "
            "replica's secret cannot be checked against the fleet's, so it does not start. "
            "Delete those keys (the first replica to start sets the fingerprint again), or give "
            "this fleet a prefix of its own (redis_prefix)"
        )
    if outcome == "legacy":
        raise ConfigError(
            f"Redis {where} holds {legacy_key}, the server secret in clear text as an older "
            f"tiercache release shared it, and it is not this replica's secret ({source}). "
            "This release never takes its secret from Redis (whoever can write Redis could "
            "choose it, whoever can read Redis could read it): the fleet's secret is now "
            f"distributed as a file. Give every replica the same secret ({copy_hint}), then "
            f"delete {legacy_key} from Redis"
        )
    if stored is not None and not hmac.compare_digest(stored, fingerprint):
        raise ConfigError(
            f"this replica's server secret ({source}) is not the fleet's: Redis {where} holds "
            f"the fingerprint of another secret in {fingerprint_key}. Replicas sharing a Redis "
            f"must share one secret (tenant scopes, digests and the signatures of every value "
            f"in Redis derive from it): {copy_hint}. To move the whole fleet to a new secret, "
            f"stop every replica and delete {fingerprint_key}"
        )
    return True


def check_eviction_policy(
    link: RedisLink, entries_expire: bool, environ: Mapping[str, str] | None = None
) -> str | None:
    """Check, at start, that Redis cannot evict the control keys: read `maxmemory-policy` and
    `maxmemory` (`CONFIG GET`). An `allkeys-*` policy with `maxmemory` set is a ConfigError
    (Redis may evict the invalidation log, so that a replica that was down serves what was
    invalidated, and the secret's fingerprint), unless `$TIERCACHE_REDIS_ALLOW_ALLKEYS_EVICTION`
    is `1` in `environ` (None: the process's; warned). A `volatile-*` policy with `maxmemory`
    while L3 entries carry no TTL (`entries_expire` False: `redis_max_ttl_s` and `ttl_s` both 0)
    is warned about: Redis can evict nothing, and writes fail once it is full.

    The policy read; None, with a warning saying what to check, when Redis did not answer or
    refused `CONFIG` (a managed Redis, an ACL user without `config|get`)."""
    env = os.environ if environ is None else environ
    where = link.url or "(injected client)"

    def read(c: redis.Redis) -> dict[str, str] | redis.exceptions.ResponseError:
        try:
            found: Any = c.config_get("maxmemory*")
        except redis.exceptions.ResponseError as exc:  # NOPERM, or CONFIG renamed away
            return exc
        return {_text(k): _text(v) for k, v in dict(found).items()}

    found = link.call(read, None)
    if not isinstance(found, dict):
        why = "did not answer" if found is None else f"refused CONFIG GET ({found})"
        log.warning(
            "Redis %s %s: its eviction policy is not checked. Check that maxmemory-policy is a "
            "volatile-* one (volatile-lru) or noeviction, never allkeys-* with maxmemory set: "
            "Redis could then evict the invalidation log and the secret's fingerprint",
            where,
            why,
        )
        return None
    policy = found.get("maxmemory-policy", "")
    try:
        max_bytes = int(found.get("maxmemory", "0") or 0)
    except ValueError:
        max_bytes = 0
    if policy.startswith("allkeys-") and max_bytes > 0:
        explain = (
            f"Redis {where} runs maxmemory-policy {policy} with maxmemory {max_bytes} bytes: "
            "when full it may evict any key, the invalidation log (<prefix>invalidated: a "
            "replica that was down would serve answers invalidated meanwhile) and the secret's "
            "fingerprint (<prefix>secret_fingerprint: a replica with another secret would "
            "start) included"
        )
        if env.get(ALLOW_ALLKEYS_ENV, "") == "1":
            log.warning("%s; starting anyway, as $%s=1 asks", explain, ALLOW_ALLKEYS_ENV)
            return policy
        raise ConfigError(
            f"{explain}. Set maxmemory-policy to a volatile-* one, e.g. `CONFIG SET "
            "maxmemory-policy volatile-lru` and the same in redis.conf: L3 entries carry a TTL "
            "(redis_max_ttl_s > 0 or ttl_s > 0), so Redis evicts them and never the control "
            f"keys, which have none. To start anyway, set ${ALLOW_ALLKEYS_ENV}=1"
        )
    if policy.startswith("volatile-") and max_bytes > 0 and not entries_expire:
        log.warning(
            "Redis %s runs maxmemory-policy %s, but L3 entries carry no TTL (redis_max_ttl_s "
            "and ttl_s are both 0): Redis can evict nothing, and writes fail once it holds "
            "maxmemory (%d bytes). Set redis_max_ttl_s (or ttl_s) above 0",
            where,
            policy,
            max_bytes,
        )
    return policy


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
