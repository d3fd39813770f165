"""Invalidation by key, tag, tenant or adapter, on every tier of every replica.

The watermark itself, and the table every read checks, are `tiercache.exact.watermarks`: once a
process has noted a watermark, no tier serves what it kills. Deleting is the second, eager step
that gives the space back, and it is this module's job, on a `TieredCache`:

- The process that receives the command (`Invalidator`) notes the watermark, drops its own L1/L2
  copies, deletes from L3 (a key directly; a tag, tenant or adapter by scanning this prefix's L3
  entries), records the watermark in Redis (`<prefix>invalidated`, a sorted set by time) and
  publishes it on the channel `<prefix>invalidations`. Past `max_events` members, it forgets
  those older than the entry lifetime horizon (the deployment's `ttl_s`) and no others: a
  replica that was down needs every watermark that covers what its L2, or an L3 left unswept,
  may still hold (`tiercache.exact.watermarks`, "Forgetting").
- Every replica process runs an `InvalidationListener` (a thread started with its cache and
  joined at close) subscribed to that channel: it notes the watermark, then sweeps its L1 and L2
  and tells its listeners (the semantic index) which digests it dropped.
- A message sent while a listener was disconnected (Redis restarted, a network blip) is not lost:
  on every (re)connect the listener first subscribes, then reads the watermarks recorded since the
  last one it saw (all of them at start), so it never misses one that Redis still holds.
- A replica that restarts sweeps its L2 once, in the background, for the watermarks recorded
  since its host's last such sweep (`RestartSweeper`): reads were already safe (the table covers
  them); this gives the space back and makes those copies gone for good.

The issuer and the listener stay in one module: they are the two ends of one Redis protocol (the
channel, the sorted set and the message format), which must change together.

Both are signed, since whoever can write Redis must not be able to wipe entries (a watermark
they invent) or resurrect them (an older `at_s` for a real one): HMAC-SHA256 under
`derive_key(secret, "invalidations")` (the link's `Signer`), bound to the sorted set's or the
channel's name. A member of `<prefix>invalidated` is `<tag hex>|<at_s>|<kind>:<value>`, its tag
over `<at_s>|<kind>:<value>` (the score only orders the set; `at_s` is read from the signed
member), so every invalidation is a member of its own, forgotten by the rule above. A
message is `Signer.seal(channel, JSON)`. What does not verify is ignored and counted
(`ListenerStats.forged`, and the link's `forged`); so are records and messages of releases
before the signatures.

L1 and L2 have no secondary index: a tag, tenant or adapter sweep decodes every entry of the tier
(L2: one read transaction, see docs/replicas.md for the cost per 10,000 entries); a key needs one
delete. The reads stay correct without the sweep, so its cost is off the request path, on the
listener thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tiercache.errors import InvalidRequest, Unavailable
from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import REDIS_INVALIDATIONS
from tiercache.exact.stores import Store, open_private
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import (
    DEFAULT_SKEW_S,
    HostWatermarks,
    Invalidation,
    InvalidationTable,
    OverflowCounter,
    applies,
    forget_before_s,
)
from tiercache.log_throttle import LogThrottle
from tiercache.threads import NamedThread
from tiercache.vocabulary import InvalidationKind, Tier

if TYPE_CHECKING:  # the Redis client is imported only by processes with L3
    from tiercache.exact.redis_tier import RedisLink, Signer

log = logging.getLogger(__name__)

_TAG_HEX = 64  # the hex of an HMAC-SHA256
APPLIED_MEMO = 4096  # messages a listener remembers having applied (replays are not swept)
CATCH_UP_PAGE = 1000  # members read per call when a listener catches up
# Members that do not verify one catch-up reads at most (a record flooded with junk is cut
# there; genuine members are all read, the pages keep memory bounded)
CATCH_UP_MAX_FORGED = 200_000
CATCH_UP_TRUNCATED_RETRY_S = 60.0  # the next attempt after a catch-up cut by a flood
# a replica whose Redis answers waits this long at start for its invalidation record to be read
# whole (a long one: every bad verdict adds a member) before it serves from its own tiers
CATCH_UP_WAIT_S = 120.0
KEEP_HEARD_BATCH = 4096  # heard watermarks kept in the host's log per write transaction
# The longest value an invalidation may name, in UTF-8 bytes (a digest is 64 characters, a
# request's tag at most 128): its member then stays under MAX_MEMBER_BYTES.
MAX_VALUE_CHARS = 512
# A member of the record is read at most this long: a genuine one is under 700 bytes. A
# longer member, planted by a Redis writer (Redis takes members of up to 512 MB), reaches the
# reader as a marker it refuses as forged (`_BOUNDED_PAGE`), so a page of CATCH_UP_PAGE
# members costs a listener at most about 2 MB, whatever the record holds.
MAX_MEMBER_BYTES = 2048
# A message on the channel longer than this is refused before its signature is checked (a
# genuine one is a few hundred bytes). What Redis sends one subscriber is bounded by its own
# `client-output-buffer-limit pubsub` (32 MB by default), not by this.
MAX_MESSAGE_BYTES = 8192

# One page of the record (ZRANGEBYSCORE ... WITHSCORES LIMIT), each member longer than ARGV[5]
# replaced inside Redis by a marker no signature verifies ("oversized:<its SHA-1>": distinct
# per member, so a page boundary at its score still skips it once read).
_BOUNDED_PAGE = """
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], ARGV[2], 'WITHSCORES', 'LIMIT',
                        ARGV[3], ARGV[4])
local longest = tonumber(ARGV[5])
for i = 1, #rows, 2 do
  if string.len(rows[i]) > longest then rows[i] = 'oversized:' .. redis.sha1hex(rows[i]) end
end
return rows
"""


# Records a member scored by Redis's clock as it is added, then publishes the message; the
# record's size. The member's own (signed) `at_s` was read from Redis's clock earlier, before
# the issuer's host log write; a score of the insertion time keeps the record in the order it
# was written, so a listener that catches up from the newest invalidation it heard (less the
# skew) also reads one whose `at_s` is older but that was recorded after it. A record that fails
# (its key of another type: planted, or left by something else) still publishes, and returns -1:
# one bad key must not keep every invalidation from the replicas that are listening.
_RECORD_AND_PUBLISH = """
local now = redis.call('TIME')
local added = redis.pcall('ZADD', KEYS[1], now[1] .. '.' .. string.format('%06d', tonumber(now[2])),
                          ARGV[1])
redis.call('PUBLISH', KEYS[2], ARGV[2])
if type(added) == 'table' and added['err'] then return -1 end
return redis.call('ZCARD', KEYS[1])
"""
_UNRECORDED_LOG = LogThrottle()


def signed_member(signer: Signer, events: str, inv: Invalidation) -> str:
    """`inv` as a member of the sorted set `events`: `<tag hex>|<at_s>|<kind>:<value>`."""
    body = f"{inv.at_s!r}|{inv.member()}"
    return f"{signer.tag(events, body.encode('utf-8')).hex()}|{body}"


def verified_member(signer: Signer, events: str, member: str | bytes) -> Invalidation | None:
    """The invalidation a member of `events` records, or None (counted by `signer`) when its
    tag does not verify: `at_s` comes from the signed member, never from the score."""
    raw = member.encode("utf-8") if isinstance(member, str) else bytes(member)
    tag_hex, sep, body = raw.partition(b"|")
    try:
        tag = bytes.fromhex(tag_hex.decode("ascii")) if len(tag_hex) == _TAG_HEX else b""
    except (UnicodeDecodeError, ValueError):
        tag = b""
    if not sep or not tag:
        signer.refuse(events)
        return None
    if not signer.verify(tag, events, body):
        return None
    at_text, _, ident = body.decode("utf-8").partition("|")
    return Invalidation.from_member(ident, float(at_text))


def _page(
    client: Any, events: str, low: str, high: str, start: int, num: int
) -> list[tuple[bytes, float]]:
    """One page of `events` by score, as (member, score); members longer than MAX_MEMBER_BYTES
    come as a marker (`_BOUNDED_PAGE`)."""
    flat: Any = client.eval(_BOUNDED_PAGE, 1, events, low, high, start, num, MAX_MEMBER_BYTES)
    return [(bytes(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]


def recorded_members(
    client: Any, events: str, since: float | None, upper: float, page: int = CATCH_UP_PAGE
) -> Iterator[bytes]:
    """The members of the sorted set `events` scored from `since` (None: the lowest) to
    `upper`, lowest first, read `page` at a time: each call bounded in size and time, however
    large the set (a member over MAX_MEMBER_BYTES comes as a marker that never verifies). Pages
    follow the scores (the next starts at the last score read, skipping the members already
    read there), so members removed below the cursor meanwhile (the record's trimming) shift
    nothing; a run of equal scores longer than a page is read by offset within that score."""
    low: str = "-inf" if since is None else repr(since)
    seen_at_low: set[bytes] = set()
    while True:
        rows = _page(client, events, low, repr(upper), 0, page)
        if not rows:
            return
        last = rows[-1][1]
        for member, _ in rows:
            if member not in seen_at_low:
                yield member
        if len(rows) < page:
            return
        if all(score == last for _, score in rows):  # a page of one score: by offset in it
            offset = len(rows)
            while True:
                more = _page(client, events, repr(last), repr(last), offset, page)
                for member, _ in more:
                    yield member
                offset += len(more)
                if len(more) < page:
                    break
            low, seen_at_low = f"({last!r}", set()
            continue
        low = repr(last)
        seen_at_low = {m for m, score in rows if score == last}


def checked_digest(value: str, what: str) -> str:
    """A hex SHA-256 digest as keys and adapter versions are written (lower case, no spaces);
    InvalidRequest otherwise, rather than an invalidation that silently matches nothing."""
    digest = value.strip().lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise InvalidRequest(f"{what} must be a 64-character hex digest, got {value!r}")
    return digest


def sweep(store: Store, inv: Invalidation, skew_s: float = DEFAULT_SKEW_S) -> list[str]:
    """Delete what `inv` kills from `store`; the keys deleted. A key costs a read and one
    delete; a tag, tenant or adapter a scan of the whole store. An entry written clearly after
    `inv` (`applies` says no: an answer generated again since) is left alone, so a message
    replayed from Redis never deletes a newer answer."""
    if inv.kind is InvalidationKind.KEY:
        held = store.peek(inv.value)
        if held is None or not applies(inv, inv.value, held, skew_s):
            return []
        # only the entry read: an answer written since (generated again) stays
        return [inv.value] if store.delete_if_same(inv.value, held) else []
    found = [(key, entry) for key, entry in store.scan() if applies(inv, key, entry, skew_s)]
    # only what the scan found: an answer written since (generated again) stays
    return store.delete_unchanged(found) if found else []


DroppedFn = Callable[[Invalidation, list[str]], None]
"""Told which digests a received invalidation dropped locally (for a key: that digest, unless a
tier, L3 included, holds an answer under it written after the invalidation); the semantic
index forgets their rows."""

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
    # messages and records ignored because their signature did not verify (forged, another
    # fleet's, an older release's)
    forged: int = 0
    truncated: int = 0  # catch-ups cut at CATCH_UP_MAX_FORGED forged members (a flood)
    catch_up_failures: int = 0  # catch-ups that failed while subscribed (retried)
    # By kind (`InvalidationKind.value`; a kind never counted may be absent):
    received_by_kind: dict[str, int] = field(default_factory=dict)  # messages, as `received`
    applied_by_kind: dict[str, int] = field(default_factory=dict)  # news: raised a watermark
    replayed_by_kind: dict[str, int] = field(default_factory=dict)  # news read on a reconnect
    dropped_by_kind: dict[str, int] = field(default_factory=dict)  # entries, as `dropped`


class InvalidationListener:
    """A background thread that applies other replicas' invalidations to one `TieredCache`.

    Subscribes to `<prefix>invalidations` on its own connection; after any error it reconnects
    every `retry_s` and catches up from `<prefix>invalidated`. Only what the fleet's secret
    signed is applied (the module docstring). `close()` stops and joins it (at most `poll_s`
    plus one Redis timeout). `on_dropped` callbacks run on this thread.
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
        self._signer = link.signer(REDIS_INVALIDATIONS)
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
        self._subscribed = threading.Event()  # Redis answered once (its record being read)
        self._keep_log = LogThrottle()
        self._lock = threading.Lock()
        self._received = self._caught_up = self._reconnects = self._dropped = 0
        self._forged = 0
        self._applied: dict[tuple[InvalidationKind, str, float, str], None] = {}
        self._truncated = 0  # catch-ups stopped at CATCH_UP_MAX_FORGED forged members
        self._catch_up_failures = 0
        self._thread: threading.Thread | None = None

    def on_dropped(self, callback: DroppedFn) -> None:
        self._callbacks.append(callback)

    def on_received(self, callback: ReceivedFn) -> None:
        self._received_callbacks.append(callback)

    def start(self) -> InvalidationListener:
        self._thread = NamedThread(target=self._run, name="tiercache-invalidations")
        self._thread.daemon = True  # never keeps a stub process alive; close() joins it
        self._thread.start()
        return self

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def caught_up(self) -> bool:
        """Whether this listener is subscribed and has noted every watermark Redis's record
        holds (False before its first catch-up, after one cut short, and while cut off)."""
        return self._connected.is_set()

    def wait_first_attempt(self, timeout_s: float, catching_up_s: float = CATCH_UP_WAIT_S) -> bool:
        """Wait (at most `timeout_s`) for the first connection attempt to end; True when it
        connected, so that every watermark recorded in Redis is noted (a replica started after
        an invalidation must not serve what its L2 kept). False at once when Redis refused.
        Redis answered but its record still being read (a long one): up to `catching_up_s`
        more, since serving before it ends serves what was invalidated while this was down."""
        if not self._attempted.wait(timeout_s) and self._subscribed.is_set():
            self._attempted.wait(catching_up_s)
        return self._connected.is_set()

    @property
    def subscribed(self) -> bool:
        """Whether Redis answered this listener at least once."""
        return self._subscribed.is_set()

    def _run(self) -> None:
        import redis  # only processes with L3 import the client

        errors = (redis.exceptions.RedisError, OSError, ValueError)
        pubsub: Any = None
        first = True  # no catch-up has completed yet: the first notes, it does not sweep
        catch_up_due: float | None = None  # monotonic time of the next catch-up attempt
        # Where the pending catch-up starts, fixed when it became due: messages handled between
        # a failed attempt and the next raise the table's newest watermark, and starting from
        # it would skip what was recorded while this replica was away.
        catch_up_since: float | None = None
        next_ping = 0.0
        heard = 0.0  # monotonic time the connection last delivered anything (a pong included)
        while not self._stop.is_set():
            if pubsub is None:
                try:
                    pubsub = self._subscribe()
                except errors as exc:
                    self._disconnected(exc, first)
                    self._attempted.set()
                    self._stop.wait(self._retry_s)
                    continue
                self._subscribed.set()
                since = self._since()
                if catch_up_due is None:  # none pending: from the newest watermark read
                    catch_up_since = since
                elif catch_up_since is not None and since is not None:  # pending: never later
                    catch_up_since = min(catch_up_since, since)
                else:
                    catch_up_since = None  # from the record's start
                catch_up_due = 0.0
                next_ping = heard = time.monotonic()
                next_ping += self._ping_s
            if catch_up_due is not None and time.monotonic() >= catch_up_due:
                # Subscribed first, so what is published meanwhile arrives on the channel; a
                # catch-up that fails (a slow or flooded record) is retried on its own while the
                # subscription stays, so the replica never stops hearing new invalidations.
                try:
                    complete = self._catch_up(catch_up_since, catch_up_sweeps=not first)
                except errors as exc:
                    self._catch_up_failed(exc, first)
                    catch_up_due = time.monotonic() + self._retry_s
                else:
                    if complete:
                        catch_up_due, catch_up_since = None, None
                        first = False
                    else:  # cut by a flood: again later, from the same point
                        catch_up_due = time.monotonic() + max(
                            self._retry_s, CATCH_UP_TRUNCATED_RETRY_S
                        )
                self._attempted.set()
                # the channel was not read meanwhile: a ping now, its pong due as usual
                heard = next_ping = time.monotonic()
            try:
                message = pubsub.get_message(ignore_subscribe_messages=True, timeout=self._poll_s)
                now = time.monotonic()
                if message is not None:
                    heard = now
                elif now - heard > 2 * self._ping_s + self._poll_s:
                    # Pinged twice and no pong: a peer gone without closing the socket (a
                    # black-holed route, a moved server). The pings themselves keep TCP's
                    # keepalive from ever probing, so only this notices.
                    raise ConnectionError(f"no answer to a ping in {now - heard:.1f} s")
                if now >= next_ping:
                    pubsub.ping()
                    next_ping = now + self._ping_s
            except errors as exc:
                self._close_quietly(pubsub)
                pubsub = None
                self._disconnected(exc, False)
                continue
            if message is None or message.get("type") != "message":
                continue
            data = message["data"]
            if not isinstance(data, bytes) or len(data) > MAX_MESSAGE_BYTES:
                data = b""  # never one this fleet sent: refused before any HMAC over it
            signed = self._signer.unseal(self.channel, data)
            if signed is None:  # forged (counted by the signer and here), never acted on
                with self._lock:
                    self._forged += 1
                continue
            try:
                inv = Invalidation.from_json(signed)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("ignored a malformed invalidation message: %s", exc)
                continue
            if inv.origin != self.table.origin:
                news = self.table.note(inv, from_redis=True)
                if news:
                    self._keep_on_host([inv])
                # A message this listener applied before (a replay of a captured one) is not
                # swept again: reads check its watermark, and a replayed tag would cost a
                # scan each time. One too old to kill anything servable is not swept either.
                # (Sweeping only news was tried and taken back: a process whose table noted
                # the watermark from the host's log first never forgot the semantic rows.)
                if self._first_hearing(inv) and not self._past_horizon(inv):
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

    def _subscribe(self) -> Any:
        pubsub = self.link.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.channel)
        except BaseException:
            self._close_quietly(pubsub)
            raise
        return pubsub

    def _since(self) -> float | None:
        """Where a catch-up starts: the newest watermark read from Redis, less the skew
        allowance (None: the record's start)."""
        newest = self.table.newest_s
        return newest - 2 * self.table.skew_s if newest else None

    def _catch_up(self, since: float | None, catch_up_sweeps: bool) -> bool:
        """Read the watermarks recorded from `since` (None: all; an invalidation published
        meanwhile arrives twice, which is harmless), in pages (`recorded_members`): scores up
        to Redis's clock now (a member scored in the future was never written by a replica).
        Every genuine member is read; past CATCH_UP_MAX_FORGED members that do not verify the
        record is flooded: logged, counted, and False (not caught up: the listener does not
        report connected, and tries again later from the same point). True when complete."""
        client = self.link.client
        seconds, micros = client.time()
        upper = float(seconds) + float(micros) / 1e6
        forged = 0
        heard: list[Invalidation] = []
        sweeps: list[Invalidation] = []
        for read, member in enumerate(recorded_members(client, self.events, since, upper)):
            if read % 1024 == 1023 and self._stop.is_set():
                return False  # closing: not caught up (the thread ends)
            try:
                found = verified_member(self._signer, self.events, member)
            except ValueError:  # signed, yet not a record: never written by this release
                found = None
            if found is None:
                forged += 1
                with self._lock:
                    self._forged += 1
                if forged >= CATCH_UP_MAX_FORGED:
                    with self._lock:
                        self._truncated += 1
                    self._connected.clear()
                    log.error(
                        "Redis's invalidation record %s holds over %d members this fleet did "
                        "not sign since %s (a flood: remove them; tiercache_redis_forged_total "
                        "counts them): the catch-up stopped there and is tried again in %.0f s; "
                        "until it completes, reads may miss watermarks recorded past them",
                        self.events,
                        CATCH_UP_MAX_FORGED,
                        since,
                        max(self._retry_s, CATCH_UP_TRUNCATED_RETRY_S),
                    )
                    self._finish_catch_up(heard, sweeps)  # what was read is not read again
                    return False
                continue
            inv = found
            # At start every recorded watermark is noted; reads check them, so no sweep is
            # needed. After an outage only the news is swept.
            news = self.table.note(inv, from_redis=True)
            if news:
                heard.append(inv)
                if len(heard) >= KEEP_HEARD_BATCH:
                    self._keep_on_host(heard)
                    heard = []
            swept = news and catch_up_sweeps and not self._past_horizon(inv)
            if swept and self._first_hearing(inv):
                sweeps.append(inv)  # swept once every watermark is noted (_finish_catch_up)
            with self._lock:
                self._caught_up += 1
                self._by_kind["applied"][inv.kind.value] += news
                self._by_kind["replayed"][inv.kind.value] += news and catch_up_sweeps
        self._finish_catch_up(heard, sweeps)
        if self._connected.is_set() is False:
            log.info("invalidation listener subscribed to %s", self.channel)
        self._connected.set()
        return True

    def _finish_catch_up(self, heard: list[Invalidation], sweeps: list[Invalidation]) -> None:
        """What a catch-up leaves until the record's every watermark read is noted (reads
        check those, so what they cover stops being served at once, however many there are):
        the news kept on the host, then each message's sweep of the local tiers (a key
        message reads L3 too, `_newer_held`: thousands of round trips after a long outage,
        which no longer hold back the watermarks after them). Closing: the sweeps are left."""
        self._keep_on_host(heard)
        for inv in sweeps:
            if self._stop.is_set():
                return
            self._apply(inv, sweep_local=True, noted=True)

    def _keep_on_host(self, heard: list[Invalidation]) -> None:
        """Into the host's log (`HostWatermarks.keep_heard`), so that a process of this host
        started later knows them without Redis's record; a failure is logged (once a minute),
        the watermarks hold in this process all the same."""
        marks = self.cache.host_marks
        if marks is None or not heard:
            return
        try:
            marks.keep_heard(heard)
        except Exception:  # noqa: BLE001 - the table holds them; the host's log is a copy
            if self._keep_log.ready():
                log.exception("keeping %d heard invalidations in the host's log failed", len(heard))

    def _catch_up_failed(self, exc: BaseException, first: bool) -> None:
        """A catch-up that failed while the subscription holds: retried every `retry_s`."""
        self._connected.clear()
        with self._lock:
            self._catch_up_failures += 1
        log.warning(
            "invalidation listener %s: reading the recorded watermarks failed (%s: %s)%s; "
            "still subscribed, retrying every %.1f s",
            self.channel,
            type(exc).__name__,
            exc,
            " at start" if first else "",
            self._retry_s,
        )

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
        if inv.kind is InvalidationKind.KEY:
            if self._newer_held(inv):  # its row now leads to the answer generated since
                digests = [d for d in digests if d != inv.value]
            elif inv.value not in digests:
                digests.append(inv.value)  # another process on the host may have swept it first
        for callback in self._callbacks:
            try:
                callback(inv, digests)
            except Exception:  # noqa: BLE001 - a listener's hook must not stop the thread
                log.exception("invalidation callback failed")

    def _first_hearing(self, inv: Invalidation) -> bool:
        """Whether this listener has not applied this very message before (its kind, value,
        time and origin; the last APPLIED_MEMO of them remembered, all forgotten when full: a
        replay past that is swept again, which `sweep`'s and `_newer_held`'s checks keep
        harmless to answers generated since)."""
        ident = (inv.kind, inv.value, inv.at_s, inv.origin)
        with self._lock:
            if ident in self._applied:
                return False
            if len(self._applied) >= APPLIED_MEMO:
                self._applied.clear()
            self._applied[ident] = None
            return True

    def _past_horizon(self, inv: Invalidation) -> bool:
        """Whether `inv` is too old to kill anything a reader would serve (the table's
        forgetting rule, `forget_before_s`): a replayed message the table had forgotten is news
        to it again, and must not sweep answers generated since."""
        cutoff = forget_before_s(self.cache.now(), self.table.horizon_s, self.table.skew_s)
        return cutoff is not None and inv.at_s < cutoff

    def _newer_held(self, inv: Invalidation) -> bool:
        """Whether a tier holds an answer under `inv`'s key written clearly after it (generated
        again since, on this host or by another replica, in L3): its semantic row is that
        answer's, not the invalidated one's (a row names a digest; its answer is read from the
        tiers). L3 is read too (one round trip per key message; none while its breaker is
        open): a late or replayed message forgot the row of an answer another replica had
        generated again, which this host's tiers did not hold yet."""
        for _, store in self.cache.stores():
            try:
                held = store.peek(inv.value)
            except Exception:  # noqa: BLE001 - unknown: forget the row (recall, not correctness)
                continue
            if held is not None and not applies(inv, inv.value, held, self.table.skew_s):
                return True
        return False

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
                forged=self._forged,
                truncated=self._truncated,
                catch_up_failures=self._catch_up_failures,
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
class RestartSweepReport:
    """What one `RestartSweeper` pass did."""

    watermarks: int  # watermarks with at_s after the host's last completed sweep
    removed: int  # L2 entries deleted: covered by those (or by any watermark the table holds)
    seconds: float
    swept_until_s: float | None  # recorded as the host's last sweep (unchanged when none was new)


class RestartSweeper:
    """Sweeps this host's L2, once, for the watermarks issued since its last completed sweep:
    those of a replica that was down (no listener ran to sweep them). Reads are safe before it
    ends (the table covers every watermark it has noted); this gives the space back and makes
    those copies gone for good, also once the watermarks are forgotten.

    A thread (`start`; `close` stops and joins it, abandoning a sweep under way, which is then
    not recorded) waits until `ready` says the table holds every recorded watermark (the
    listener's first catch-up: `InvalidationListener.wait_connected`), notes the host's log, and
    then, holding an `flock` on `<invalidations>.sweep-lock` (the processes of a host starting
    together sweep one at a time, and the later ones find nothing new): takes the watermarks
    newer than the host's last sweep (`HostWatermarks.swept_until_s`), and if there are any,
    scans L2 once, deleting what the table covers (one decode per entry however many
    watermarks: the cost of one tag sweep), and records the newest of them as the host's last
    sweep (`mark_swept`). Progress is logged: watermarks, entries removed, seconds."""

    def __init__(
        self,
        cache: TieredCache,
        marks: HostWatermarks,
        ready: Callable[[float], bool] = lambda timeout_s: True,
        poll_s: float = 0.2,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.marks = marks
        self._ready = ready
        self._poll_s = poll_s
        self._timer = timer
        self._lock_path = marks.path.with_name(marks.path.name + ".sweep-lock")
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.report: RestartSweepReport | None = None  # the last pass's, once done

    def start(self) -> RestartSweeper:
        self._thread = NamedThread(target=self._run, name="tiercache-restart-sweep")
        self._thread.daemon = True  # never keeps a stub process alive; close() joins it
        self._thread.start()
        return self

    def wait(self, timeout_s: float) -> RestartSweepReport | None:
        """Wait (at most `timeout_s`) for the thread's pass; its report, None if not done."""
        self._done.wait(timeout_s)
        return self.report

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._ready(self._poll_s):
                    self.sweep()
                    return
        except Exception:  # noqa: BLE001 - the reads stay safe; the next start sweeps again
            log.exception("sweeping this host's L2 at start failed")
        finally:
            self._done.set()

    def sweep(self) -> RestartSweepReport | None:
        """One pass, on the calling thread; None when stopped before it ended or there is no
        L2 (nothing is recorded then)."""
        l2 = self.cache.store(Tier.L2)
        if l2 is None:
            return None
        table = self.cache.invalidations
        self.marks.catch_up(table)
        fd = open_private(self._lock_path)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:  # another process of the host is sweeping
                    if self._stop.wait(self._poll_s):
                        return None
            return self._sweep_locked(l2, table)
        finally:
            os.close(fd)  # releases the lock

    def _sweep_locked(self, l2: Store, table: InvalidationTable) -> RestartSweepReport | None:
        started = self._timer()
        last_s = self.marks.swept_until_s()
        news = table.since(last_s)
        if not news:
            log.debug("L2 already swept for every watermark this replica knows")
            self.report = RestartSweepReport(0, 0, self._timer() - started, last_s)
            return self.report
        log.info(
            "sweeping this host's L2 for %d invalidation watermarks issued since its last sweep",
            len(news),
        )
        victims: list[tuple[str, CacheEntry]] = []
        scanned = 0
        entries = l2.scan()
        try:
            for key, entry in entries:
                scanned += 1
                if scanned % 1024 == 0 and self._stop.is_set():
                    log.info("L2 sweep at start stopped after %d entries (closing)", scanned)
                    return None
                if table.covers(key, entry):
                    victims.append((key, entry))
        finally:
            close = getattr(entries, "close", None)
            if close is not None:
                close()  # ends the scan's read transaction
        # only what the scan found: an answer written since (generated again) stays
        removed = len(l2.delete_unchanged(victims)) if victims else 0
        until_s = news[-1].at_s
        self.marks.mark_swept(until_s)
        seconds = self._timer() - started
        log.info(
            "swept this host's L2 for %d watermarks: %d of %d entries removed in %.2f s",
            len(news),
            removed,
            scanned,
            seconds,
        )
        self.report = RestartSweepReport(len(news), removed, seconds, until_s)
        return self.report

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


MAX_PENDING = 4096  # invalidations applied while Redis was down, kept to publish again


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
    What it records and publishes is signed under the link's secret: the replicas apply it only
    if that is the fleet's secret.
    """

    def __init__(
        self,
        cache: TieredCache,
        link: RedisLink | None = None,
        max_events: int | None = None,
    ) -> None:
        """The Redis log is trimmed by the rule of `cache.invalidations` (its `horizon_s`, the
        deployment's `ttl_s`, and its skew allowance): past `max_events` (default: the table's)
        members are forgotten only once older than the horizon; none without one."""
        self.cache = cache
        self.link = link
        table = cache.invalidations
        self.max_events = table.max_events if max_events is None else max_events
        self.horizon_s = table.horizon_s
        self._overflow = OverflowCounter("Redis's invalidation log")
        self._lock = threading.Lock()
        self._issued: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()
        self._published = 0
        self._unrecorded = 0  # published, but Redis's log key was not a sorted set
        # Redis's clock less this host's, at the last invalidation with Redis (None before)
        self.redis_clock_offset_s: float | None = None
        self._clock_log = LogThrottle()
        # applied here but not published (Redis down): member -> (kind, value, sweep_shared),
        # the oldest first, for `publish_pending`
        self._pending: OrderedDict[str, tuple[InvalidationKind, str, bool]] = OrderedDict()

    def invalidate(
        self, kind: InvalidationKind, value: str, sweep_shared: bool = True
    ) -> InvalidationReport:
        """`sweep_shared` False leaves matching L3 entries to expire (they are never served:
        every reader checks the watermark), avoiding a scan of every L3 entry."""
        if not value:
            raise ValueError(f"an invalidation by {kind.value} needs a value")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_VALUE_CHARS:  # an admin's non-ASCII tag, too: its member must fit
            raise InvalidRequest(
                f"an invalidation by {kind.value} names at most {MAX_VALUE_CHARS} characters "
                f"(UTF-8 bytes), got {size}"
            )
        table = self.cache.invalidations
        redis_s = self._redis_time()
        if redis_s is not None:
            self._check_clock(redis_s)
        at_s = self.cache.now() if redis_s is None else redis_s
        inv = Invalidation(kind, value, at_s, table.origin)
        table.note(inv)
        host_failed: BaseException | None = None
        if self.cache.host_marks is not None:
            try:
                self.cache.host_marks.record(inv)  # the host's other processes, before the sweep
            except Exception as exc:  # noqa: BLE001 - the sweep and Redis still reach what they reach
                log.exception("recording %s in the host's invalidation log failed", inv.member())
                host_failed = exc
        local = 0
        for _, store in self.cache.local_stores():
            local += len(sweep(store, inv, table.skew_s))
        self._count(inv, local, issued=True)
        link = self.link
        if link is None:
            if host_failed is not None:  # nothing else tells the host's other processes
                raise Unavailable(
                    f"the host's invalidation log could not record the invalidation of "
                    f"{kind.value} {value!r} ({type(host_failed).__name__}: {host_failed}): "
                    "it was applied in this process and swept from this host's L2; the other "
                    "processes of the host keep serving their own copies (L1) until they "
                    "restart"
                )
            return InvalidationReport(inv, local, 0, False)
        if redis_s is None:
            self._keep_pending(inv, sweep_shared)
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
                self._pending.pop(inv.member(), None)
        except BaseException:
            self._keep_pending(inv, sweep_shared)
            raise
        finally:  # swept also when publishing failed: what L3 holds is dropped either way
            l3 = self.cache.store(Tier.L3)
            if l3 is not None and (kind is InvalidationKind.KEY or sweep_shared):
                shared = len(sweep(l3, inv, table.skew_s))
            self._count(inv, shared)
        return InvalidationReport(inv, local, shared, True)

    def _keep_pending(self, inv: Invalidation, sweep_shared: bool) -> None:
        """Keep `inv`, applied here but not published, for `publish_pending` (at most
        MAX_PENDING, the oldest dropped first, logged)."""
        with self._lock:
            self._pending.pop(inv.member(), None)
            self._pending[inv.member()] = (inv.kind, inv.value, sweep_shared)
            while len(self._pending) > MAX_PENDING:
                member, _ = self._pending.popitem(last=False)
                log.warning("an unpublished invalidation (%s) is no longer kept to publish", member)

    def unpublished(self, kind: InvalidationKind, value: str) -> bool:
        """Whether an invalidation of `kind` `value` was applied here and not published."""
        with self._lock:
            return f"{kind.value}:{value}" in self._pending

    def publish_pending(self) -> int:
        """Issue again, now that Redis may answer, the invalidations applied here while it did
        not (Redis's clock times them anew: a replica that reconnects catches up from the
        newest score it saw). How many were published; stops at the first that is not."""
        with self._lock:
            pending = list(self._pending.values())
        published = 0
        for kind, value, sweep_shared in pending:
            try:
                self.invalidate(kind, value, sweep_shared)
            except Unavailable:
                break
            published += 1
        return published

    def _count(self, inv: Invalidation, dropped: int, issued: bool = False) -> None:
        with self._lock:
            self._issued[inv.kind.value] += issued
            self._dropped[inv.kind.value] += dropped

    def stats(self) -> InvalidatorStats:
        with self._lock:
            return InvalidatorStats(dict(self._issued), self._published, dict(self._dropped))

    def _check_clock(self, redis_s: float) -> None:
        """Warn (at most once a minute) when Redis's clock, which times every watermark, is
        off this host's by more than the skew allowance: behind, an answer this host (or a
        replica on its time) made up to that offset before the invalidation is not covered
        by it and stays served; ahead, answers made up to that offset after it are dropped.
        Every replica's and Redis's clocks must agree within `skew_s` (NTP)."""
        offset = redis_s - self.cache.now()
        self.redis_clock_offset_s = offset
        skew_s = self.cache.invalidations.skew_s
        if abs(offset) > skew_s and self._clock_log.ready():
            log.warning(
                "Redis's clock is %.3f s %s this host's (past the %.3f s skew allowance): "
                "invalidations are timed by Redis's clock, so %s; synchronise the clocks (NTP)",
                abs(offset),
                "behind" if offset < 0 else "ahead of",
                skew_s,
                "an answer made here just before one is not covered by it and stays served"
                if offset < 0
                else "answers made here just after one are dropped too",
            )

    def _redis_time(self) -> float | None:
        """Redis's clock (every replica's watermarks on one clock); None without Redis."""
        if self.link is None:
            return None
        found: Any = self.link.call(lambda c: c.time(), None)
        return None if found is None else float(found[0]) + float(found[1]) / 1e6

    def _record(self, client: Any, link: RedisLink, inv: Invalidation) -> None:
        """Record the watermark (for replicas that connect later), publish it, then, past
        `max_events`, forget the members older than the horizon (`forget_before_s` at `inv.at_s`:
        scores and now both on Redis's clock). What is younger stays: a replica that was down
        needs it for what its L2 or an unswept L3 still holds."""
        events, channel = link.key("invalidated"), link.key("invalidations")
        signer = link.signer(REDIS_INVALIDATIONS)
        message = replace(inv, published_s=self.cache.now()).to_json().encode("utf-8")
        held = int(
            client.eval(
                _RECORD_AND_PUBLISH, 2, events, channel,
                signed_member(signer, events, inv), signer.seal(channel, message),
            )
        )  # fmt: skip
        if held < 0:
            with self._lock:
                self._unrecorded += 1
            if _UNRECORDED_LOG.ready():
                log.error(
                    "invalidation published but not recorded: %s is not a sorted set (planted, "
                    "or written by something else), so replicas that connect later cannot catch "
                    "up on it; delete that key (%d such invalidations, %d lines not logged)",
                    events,
                    self._unrecorded,
                    _UNRECORDED_LOG.suppressed,
                )
            return
        if held <= self.max_events:
            return
        cutoff = forget_before_s(inv.at_s, self.horizon_s, self.cache.invalidations.skew_s)
        if cutoff is not None:
            held -= int(client.zremrangebyscore(events, "-inf", f"({cutoff!r}"))
        if held > self.max_events:
            with self._lock:
                self._overflow.kept(held, self.max_events, self.horizon_s, inv.at_s)

    @property
    def kept_past_max(self) -> int:
        """Invalidations recorded while Redis's log held more than `max_events` members, none
        of the oldest old enough to forget."""
        with self._lock:
            return self._overflow.count

    def key(self, digest: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.KEY, digest, sweep_shared)

    def tag(self, name: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.TAG, name, sweep_shared)

    def tenant(self, scope: str, sweep_shared: bool = True) -> InvalidationReport:
        """By tenant scope (`tiercache.exact.keys.tenant_scope(secret, tenant)`): every replica
        has the fleet's secret (`tiercache.exact.redis_tier.check_fleet_secret` refuses a replica
        with another), so one scope names the tenant there."""
        return self.invalidate(InvalidationKind.TENANT, scope, sweep_shared)

    def adapter(self, digest: str, sweep_shared: bool = True) -> InvalidationReport:
        return self.invalidate(InvalidationKind.ADAPTER, digest, sweep_shared)
