"""The exact cache: L1 (this process) in front of L2 (shared on the host) in front of an optional
L3 (Redis, shared by every replica), read-through.

The tiers are an ordered list of `TierSlot`s, nearest first, each saying who else reads it
(`Reach`). A read tries each tier in turn; a hit in a lower tier is copied into the tiers above it
(an L3 hit fills L2 and L1). A write goes to the shared tiers first, nearest first (L2, which the
other processes of the host see, then L3, which other replicas see: a peer waiting for the answer
sees it as early as possible), then to this process's own (L1). Expiry is checked on every read
with the injected clock, and so are invalidations
(`tiercache.exact.watermarks.InvalidationTable`): an expired or invalidated entry is a miss in
every tier and is dropped where it was found. A `max_age_s` read only skips entries that are too
old for that one request; they stay for others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol

from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore, Store
from tiercache.exact.watermarks import HostWatermarks, InvalidationTable
from tiercache.log_throttle import LogThrottle
from tiercache.threads import NamedThread
from tiercache.vocabulary import Tier

log = logging.getLogger(__name__)
_SIDE_FAILURES_LOG = LogThrottle()  # a shared tier that keeps failing side records


@dataclass(frozen=True, slots=True)
class Lookup:
    entry: CacheEntry
    tier: Tier


_MISPLACED_LOG = LogThrottle()  # values under a request's key made for another: once a minute


def made_for(found: Lookup | None, tenant_scope: str, adapter: str) -> Lookup | None:
    """`found` when its entry was stored for a request of `tenant_scope` and `adapter`
    (`CacheEntry.made_for`), else None, logged: L2's checksum does not cover the key (L3's
    signature does), so a value moved under another key (a damaged page pointer, a local
    writer) would be served as that request's answer, another tenant's included. The
    callers treat it as a miss, and the answer generated again is written over it."""
    if found is None or found.entry.made_for(tenant_scope, adapter):
        return found
    if _MISPLACED_LOG.ready():
        log.error(
            "a cached answer under a request's key belongs to another tenant or adapter: a "
            "miss (%d such values not logged)",
            _MISPLACED_LOG.suppressed,
        )
    return None


class Reach(str, Enum):
    """Who reads a tier besides this process: what decides the order of writes (shared tiers
    first) and what an invalidation message makes each process drop (this host's tiers)."""

    PROCESS = "process"  # this process alone (L1)
    HOST = "host"  # every process of this host (L2)
    FLEET = "fleet"  # every replica (L3)


USUAL_REACH = {Tier.L1: Reach.PROCESS, Tier.L2: Reach.HOST, Tier.L3: Reach.FLEET}
"""Each tier's reach, as `tiercache.vocabulary.Tier` defines the tiers."""


@dataclass(frozen=True, slots=True)
class TierSlot:
    """One tier of a `TieredCache`: its name, its store and who else reads it."""

    tier: Tier
    store: Store
    reach: Reach

    @classmethod
    def of(cls, tier: Tier, store: Store) -> TierSlot:
        """A slot with the tier's usual reach (`USUAL_REACH`)."""
        return cls(tier, store, USUAL_REACH[tier])


ENDORSEMENT_CHECK_S = 30.0  # an L1 copy's verdicts compared with the shared tiers' (per key)
# ... but only when L2 was written since the last comparison (its change token moved), or this
# long after it whatever the token says (a bound on what a token could miss)
ENDORSEMENT_RECHECK_S = 600.0
MAX_CHECKED_KEYS = 100_000  # the keys whose last comparison is remembered
ENDORSEMENT_QUEUE = 1024  # comparisons waiting for the background thread, at most


class _Due(NamedTuple):
    """A comparison `_check_endorsements` queued: the key, its L1 copy's answer (`created_s`)
    and verdicts, the L1 holding it (None: an L2 hit behind Redis), and when it was checked."""

    key: str
    created_s: float
    endorsements: int
    l1: MemoryStore | None
    checked_s: float


class Closeable(Protocol):
    def close(self) -> None: ...


# How far a merged side record is back-dated towards the record it merges: an invalidation
# issued that long before the merge and heard after it (listener lag, a reconnect's catch-up)
# still covers what the record carries; a longer outage of the listener is not covered
SIDE_LAG_S = 60.0


class TieredCache:
    """`tiers`, nearest first: `TierSlot`s, or (Tier, Store) pairs that take the tier's usual
    reach. Any tier may be left out: the llm stage writes through L2 (and L3) only, since its own
    L1 would never be read (lookups happen in the prompt_cache process, whose L1 fills on the
    first hit). A tier named twice is a ValueError.

    `background` holds what runs beside the tiers and is closed first (the invalidation
    listener, `tiercache.exact.invalidation.InvalidationListener`).

    `default_ttl_s` is also the horizon of its `invalidations` (`InvalidationTable.horizon_s`):
    no read serves an answer older than it, so a watermark older than that may be forgotten.
    A table given with a horizon longer than `default_ttl_s` (or any horizon when it is 0) is a
    ValueError; without one, the cache makes its own with that horizon on its clock.
    """

    def __init__(
        self,
        tiers: Sequence[TierSlot | tuple[Tier, Store]],
        *,
        clock: Callable[[], float] = time.time,
        default_ttl_s: float = 0.0,
        invalidations: InvalidationTable | None = None,
        background: Sequence[Closeable] = (),
        host_marks: HostWatermarks | None = None,
        endorsement_check_s: float = ENDORSEMENT_CHECK_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tiers = tuple(t if isinstance(t, TierSlot) else TierSlot.of(*t) for t in tiers)
        names = [t.tier for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"a tier named twice in {[n.value for n in names]}")
        self._stores = [(t.tier, t.store) for t in self.tiers]
        first = self._stores[0][1] if self._stores else None
        self._l1 = first if isinstance(first, MemoryStore) else None  # this process's, if any
        # Shared tiers first (peers see the answer soonest), nearest first; then this process's.
        self._write_order = [t for t in self.tiers if t.reach is not Reach.PROCESS] + [
            t for t in self.tiers if t.reach is Reach.PROCESS
        ]
        self._clock = clock
        self.default_ttl_s = default_ttl_s
        if invalidations is None:  # forgets by this cache's horizon, on its clock
            invalidations = InvalidationTable(horizon_s=default_ttl_s or None, clock=clock)
        horizon_s = invalidations.horizon_s
        if horizon_s is not None and not 0 < default_ttl_s <= horizon_s:
            raise ValueError(
                f"an invalidation table that forgets watermarks after {horizon_s:g} s cannot "
                f"guard a cache that serves answers up to {default_ttl_s:g} s old (0: any age): "
                "an invalidated answer would be served again"
            )
        self.invalidations = invalidations
        self.background = list(background)
        self.host_marks = host_marks  # the host's invalidation log: noted before every read
        self._catch_up_logged_s = -60.0
        # An L1 copy's `good` verdicts, compared with the shared tiers' at most this often per
        # key (a hit's read of L2/L3, not every hit's): when feedback endorsed the answer since
        # L1 took its copy (in another process, on another replica), L1 counts the new verdicts.
        self.endorsement_check_s = endorsement_check_s
        self.l1_replaced = 0  # L1 copies dropped: every shared tier held a newer answer
        self._monotonic = monotonic
        # key -> (when its copy was last checked, L2's change token as read before its last
        # comparison that went through (None: compare at the next check), when that was)
        self._checked: dict[str, tuple[float, int | None, float]] = {}
        # An L2 hit compares too where Redis may hold newer verdicts (no L1 here, or L1 no
        # longer holds the key: this host's L2 copy is otherwise compared only on L1 hits).
        self._l2_behind_l3 = any(t is Tier.L3 for t, _ in self._stores)
        # Without Redis, every change a comparison could find was written to this host's L2,
        # whose change token then moved (`LmdbStore.change_token`: LMDB's last transaction id,
        # whoever wrote): a check finding the token of the L2 snapshot the key's last
        # comparison read skips it. With Redis, another host's verdicts move no token here.
        l2 = self.store(Tier.L2)
        self._change_token: Callable[[], int | None] | None = (
            None if self._l2_behind_l3 else getattr(l2, "change_token", None)
        )
        self.endorsement_checks_skipped = 0  # checks that found L2 unchanged (no comparison)
        self.endorsements_compared = 0  # comparisons made (its thread only)
        self._due: queue.Queue[_Due | None] | None = None
        self._checker: threading.Thread | None = None  # started by the first comparison
        self._checker_lock = threading.Lock()
        self.endorsements_caught = 0  # verdicts L1 copies took up this way (its thread only)
        self.l2_endorsements_caught = 0  # and this host's L2 copies, from L3 (idem)
        self._compare_logged_s = float("-inf")  # a failing comparison: logged once a minute

    def now(self) -> float:
        """The wall clock entries are stamped with (`created_s`)."""
        return self._clock()

    def get(self, key: str, max_age_s: float | None = None, request: bool = True) -> Lookup | None:
        """The freshest usable entry, from the highest tier that has one; None on a miss. A tier
        that fails to read is a miss in that tier (logged), never an error: the request goes on
        to a lower tier or to the engine. `default_ttl_s` caps the age of what this cache
        serves, whatever TTL the writer gave the entry (prompt_cache reads what llm wrote).
        A miss in L1 on an answer it evicted lately is a hit one more byte of L1 would have had
        (`MemoryStore.credit_miss`), unless a lower tier held it unusable (expired, invalidated,
        too old: L1 would have missed too) or the read is not a request's (`request` False:
        a draft's or a row's lookup)."""
        self._catch_up()
        now = self._clock()
        tiers = self._stores
        l1 = self._l1 if request else None
        l1_missed = 0.0  # when L1 missed: what the lower tiers then cost is what L1 would save
        unusable = False  # a lower tier held it, but not fit to serve
        for i, (tier, store) in enumerate(tiers):
            if i == 1 and l1 is not None:
                l1_missed = time.perf_counter()
            try:
                # a read that is not a request (a draft's, a row's) counts no hit or request
                # in a tier's eviction values
                entry = store.get(key) if request else store.peek(key)
            except Exception:  # noqa: BLE001 - a broken tier costs a miss, not the request
                log.exception("reading %s from %s failed; a miss there", key, tier.value)
                continue
            if entry is None:
                continue
            if entry.expired(now) or self.invalidations.covers(key, entry):
                self._drop(tier, store, key, entry)
                unusable = True
                continue
            age_s = now - entry.created_s
            if self.default_ttl_s > 0 and age_s >= self.default_ttl_s:
                unusable = True
                continue  # too old for this reader; the writer's TTL may keep it for others
            if max_age_s is not None and age_s > max_age_s:
                unusable = True
                continue
            if i == 0 and l1 is not None:
                self._check_endorsements(key, entry, l1)
            elif tier is Tier.L2 and self._l2_behind_l3:
                self._check_endorsements(key, entry, l1)
            if i > 0 and l1 is not None:
                l1.credit_miss(key, time.perf_counter() - l1_missed)
            for upper_tier, upper in tiers[:i]:
                try:
                    upper.put(key, entry)
                except Exception:  # noqa: BLE001 - a failed fill (a full disk) must not fail a hit
                    log.exception("filling %s with %s failed", upper_tier.value, key)
            return Lookup(entry, tier)
        if l1 is not None and not unusable:
            l1.credit_miss(key)  # to the engine: its generation seconds, if L1 evicted it lately
        elif l1 is not None:
            l1.forget_evicted(key)
        return None

    def _check_endorsements(self, key: str, held: CacheEntry, l1: MemoryStore | None) -> None:
        """On an L1 hit, or an L2 hit with Redis behind it, at most once per
        `endorsement_check_s` per key (the first hit only starts the clock: the copy was taken
        from those tiers just now): queue a comparison of the copy's `good` verdicts with the
        shared tiers' copy of the same answer, made off the request's thread
        (`_compare_endorsements`); a full queue drops it (a later hit asks again). Without
        Redis, a check that finds L2's change token as it was before the key's last comparison
        skips it (nothing was written to L2 since, so nothing it could find changed), up to
        `ENDORSEMENT_RECHECK_S` after that comparison. The hit itself pays a clock read and a
        dict lookup; a check, a read of the token too."""
        if self.endorsement_check_s <= 0:
            return
        now = self._monotonic()
        seen = self._checked.get(key)
        if seen is not None and now - seen[0] < self.endorsement_check_s:
            return
        if len(self._checked) >= MAX_CHECKED_KEYS:
            # Forgotten whole, by a new dict: hits on other threads write to this memo without
            # a lock, so no iteration over it is safe (even a copy of its items can be cut
            # short by a collection that lets another thread run). A key forgotten starts its
            # clock again at its next hit.
            self._checked = {}
        if seen is None:
            self._checked[key] = (now, None, now)
            return
        # the token of the L2 snapshot the key's last comparison read (`_compare_one`): one
        # written since shows here, in L2's meta page, no later than to a new read
        token = None if self._change_token is None else self._change_token()
        if token is not None and token == seen[1] and now - seen[2] < ENDORSEMENT_RECHECK_S:
            self._checked[key] = (now, token, seen[2])
            self.endorsement_checks_skipped += 1
            return
        # a token is kept once the comparison went through (`_compare_endorsements`); until
        # then, and if it fails or a full queue drops it, the next check compares
        self._checked[key] = (now, None, seen[2])
        due = _Due(key, held.created_s, held.endorsements, l1, now)
        with contextlib.suppress(queue.Full):
            self._endorsement_queue().put_nowait(due)

    def _endorsement_queue(self) -> queue.Queue[_Due | None]:
        due = self._due
        if due is None:
            with self._checker_lock:
                if self._due is None:
                    self._due = queue.Queue(maxsize=ENDORSEMENT_QUEUE)
                    self._checker = NamedThread(
                        target=self._compare_endorsements, name="l1-endorsements", daemon=True
                    )
                    self._checker.start()
                due = self._due
        return due

    def _compare_endorsements(self) -> None:
        """The comparisons `_check_endorsements` queued: each shared tier's copy read as no
        request reads it (`peek`: nothing counted; L3's answers None at once while Redis is
        known down); when one holds more verdicts for the same answer (same `created_s`), L1
        counts the new ones (`MemoryStore.endorse`). A failing tier is skipped: a rank, never
        the answer. A comparison that read every shared tier keeps the change token of the L2
        snapshot it read, so the key's next check can skip (`_check_endorsements`) while L2
        has had no write since; one that did not, none."""
        due = self._due
        assert due is not None
        while True:
            item = due.get()
            if item is None:
                due.task_done()
                return
            try:
                read, token = self._compare_one(
                    item.key, item.created_s, item.endorsements, item.l1
                )
                if read:
                    self.endorsements_compared += 1
                    if token is not None and self._change_token is not None:
                        self._checked[item.key] = (item.checked_s, token, item.checked_s)
            except Exception:  # noqa: BLE001 - one comparison lost, never the thread
                now = time.monotonic()
                if now - self._compare_logged_s >= 60.0:
                    self._compare_logged_s = now
                    log.exception(
                        "comparing %s's verdicts with the shared tiers failed", item.key[:12]
                    )
            finally:
                due.task_done()

    def _compare_one(
        self, key: str, created_s: float, count: int, l1: MemoryStore | None
    ) -> tuple[bool, int | None]:
        """One comparison (`_compare_endorsements`): whether every shared tier could be read,
        and the change token of the L2 snapshot it read (None: an L2 without one)."""
        failed: list[Tier] = []
        tokens: list[int] = []
        shared = self._shared_copies(key, failed, tokens)
        token = tokens[0] if tokens else None
        if l1 is not None and shared and all(c[2].created_s > created_s for c in shared):
            # Every shared tier holds a newer answer (a warm, a `no-cache` request, on another
            # process): L1's copy was replaced, and without a TTL it was served for good.
            held = l1.peek(key)
            if held is not None and held.created_s == created_s and l1.delete_if_same(key, held):
                self.l1_replaced += 1
            return not failed, token
        copies = [c for c in shared if c[2].created_s == created_s]
        best = max([count, *(entry.endorsements for _, _, entry in copies)])
        if best > count and l1 is not None:  # L1's copy, if it holds one (0 otherwise)
            self.endorsements_caught += l1.endorse(key, created_s, best)
        # this host's L2 behind the fleet (the verdict was given on another host, L3 has it):
        # its copy takes the verdicts too, so L2's eviction ranks the answer as endorsed
        for tier, store, entry in copies:
            endorse = getattr(store, "endorse", None)
            if tier is not Tier.L2 or endorse is None or entry.endorsements >= best:
                continue
            if self.invalidations.covers(key, entry):
                continue
            self.l2_endorsements_caught += endorse(key, created_s, best)  # errors: logged above
        return not failed, token

    def shared_copies(self, key: str) -> list[CacheEntry]:
        """`key`'s entry as each shared tier (not L1) holds it, read as no request reads it
        (`peek` where a store has one: nothing counted, nothing dropped); a tier that fails to
        read is skipped (logged). Expiry and invalidations are the caller's to judge."""
        return [entry for _, _, entry in self._shared_copies(key)]

    def _shared_copies(
        self, key: str, failed: list[Tier] | None = None, tokens: list[int] | None = None
    ) -> list[tuple[Tier, Store, CacheEntry]]:
        """As `shared_copies`, with each entry's tier and store; a tier that failed to read is
        added to `failed`. With `tokens`, an L2 that has change tokens is read with its
        snapshot's (`LmdbStore.peek_with_token`, which raises where `peek` would say None for
        a damaged page), appended to it."""
        copies: list[tuple[Tier, Store, CacheEntry]] = []
        for tier, store in self._stores:
            if tier is Tier.L1:
                continue
            try:
                with_token = getattr(store, "peek_with_token", None)
                if tokens is not None and tier is Tier.L2 and with_token is not None:
                    entry, token = with_token(key)
                    tokens.append(token)
                else:
                    peek = getattr(store, "peek", None)
                    entry = peek(key) if peek is not None else store.get(key)
            except Exception:  # noqa: BLE001 - a broken tier: the others decide
                log.exception("reading %s from %s failed", key[:12], tier.value)
                if failed is not None:
                    failed.append(tier)
                continue
            if entry is not None:
                copies.append((tier, store, entry))
        return copies

    def wait_endorsements(self, timeout_s: float = 10.0) -> bool:
        """Wait until the queued comparisons are done (tests); False on timeout."""
        due = self._due
        deadline = time.monotonic() + timeout_s
        while due is not None and due.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def peek(self, key: str) -> CacheEntry | None:
        """The usable entry `get` would serve, read without counting a hit or a request (in
        L1's order or L2's values) and without filling or dropping anything: for reads that are
        not requests (feedback checking the answer it is about). A tier that fails to read is
        a miss there."""
        self._catch_up()
        now = self._clock()
        for tier, store in self._stores:
            try:
                peek = getattr(store, "peek", None)
                entry = peek(key) if peek is not None else store.get(key)
            except Exception:  # noqa: BLE001 - a broken tier is a miss there
                log.exception("reading %s from %s failed; a miss there", key, tier.value)
                continue
            if entry is None or entry.expired(now) or self.invalidations.covers(key, entry):
                continue
            if self.default_ttl_s > 0 and now - entry.created_s >= self.default_ttl_s:
                continue
            return entry
        return None

    def exists(self, key: str) -> bool:
        """Whether some tier holds a usable entry (not expired, not older than `default_ttl_s`,
        not invalidated), without filling tiers or dropping anything; a tier that fails to read
        raises. For decisions that must not take an error for a miss (compaction deletes the
        rows of answers that are gone)."""
        self._catch_up()
        now = self._clock()
        for _, store in self._stores:
            # L2's and Redis's reads say None when they could not read: ask strictly, so a
            # damaged page or an outage is an error here, never "gone" (compaction would delete
            # the rows of every answer held only there); not a request: nothing counted
            strict = getattr(store, "get_or_raise", None)
            entry = strict(key) if strict is not None else store.peek(key)
            if entry is None or entry.expired(now):
                continue
            if self.default_ttl_s > 0 and now - entry.created_s >= self.default_ttl_s:
                continue  # too old for this reader, as in get(); its watermark may be forgotten
            if not self.invalidations.covers(key, entry):
                return True
        return False

    def invalidates(self, key: str, entry: CacheEntry) -> bool:
        """Whether an invalidation this process knows of (the host's log caught up first)
        covers `entry` under `key`: for an answer not stored yet (one being generated)."""
        self._catch_up()
        return self.invalidations.covers(key, entry)

    def answer_value(self, key: str) -> float:
        """What `key`'s answer is worth to this host's L2 (its GreedyDual-Size-Frequency value,
        `tiercache.exact.l2_values`); 0.0 when unknown (no L2 values, or none for the key): for
        ranking what depends on answers, as the semantic rows do when they must give some up."""
        l2 = self.store(Tier.L2)
        value = l2.value(key) if isinstance(l2, LmdbStore) else None
        return 0.0 if value is None else value

    def put(
        self,
        key: str,
        text: str,
        *,
        ttl_s: float | None = None,
        finish_reason: str = "stop",
        generated_tokens: int = 0,
        tags: tuple[str, ...] = (),
        tenant_scope: str = "",
        adapter: str = "",
        created_s: float | None = None,
        prompt_tokens: int = 0,
        mean_logprob: float | None = None,
        generation_s: float = 0.0,
        temperature: float = 0.0,
    ) -> CacheEntry | None:
        """Store an answer in every tier; None, writing nothing, when an invalidation this
        process knows of already covers it (a generation that started before the watermark:
        readers that know it refuse the answer, and a process that has not noted it yet
        would serve it).
        `created_s` (default: now) is when its generation started; `tags`, `tenant_scope`
        and `adapter` are what invalidations match on."""
        return self.put_entry(
            key,
            CacheEntry(
                text=text,
                created_s=self._clock() if created_s is None else created_s,
                ttl_s=self.default_ttl_s if ttl_s is None else ttl_s,
                finish_reason=finish_reason,
                generated_tokens=generated_tokens,
                tags=tags,
                tenant_scope=tenant_scope,
                adapter=adapter,
                prompt_tokens=prompt_tokens,
                mean_logprob=mean_logprob,
                generation_s=generation_s,
                temperature=temperature,
            ),
        )

    def put_entry(self, key: str, entry: CacheEntry) -> CacheEntry | None:
        """`put` of a whole entry (a stored one, changed: feedback's endorsement); the same
        rules: None, writing nothing, when an invalidation this process knows of covers it."""
        self._catch_up()
        if self.invalidations.covers(key, entry):
            log.info(
                "not storing %s: an invalidation issued since its generation began covers it", key
            )
            return None
        # Each tier on its own: a full local disk must not keep the answer from L3 (other
        # replicas wait for it there) or from L1. The first failure is raised after the others.
        failure: Exception | None = None
        for slot in self._write_order:
            try:
                slot.store.put(key, entry)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                failure = failure or exc
        if failure is not None:
            raise failure
        return entry

    def endorse_entry(self, key: str, created_s: float, endorsements: int) -> int:
        """Give `key`'s answer made at `created_s` `endorsements` `good` verdicts in every tier
        that holds that answer (feedback's endorsement), and in no other: a tier holding a
        newer answer (generated again elsewhere, no watermark) or none (evicted) is left as it
        is, where writing the endorsed copy back would revert or refill it. Stores that endorse
        in place (L1, L2) re-read their copy under their own lock or transaction; L3 is written
        by a compare-and-set (`RedisStore.merge`) only while it holds that answer (another
        replica replacing it in between is read again, and left). A copy an invalidation this
        process knows of covers (by key, tenant, tag or adapter) is left as it is. How many
        tiers took it."""
        self._catch_up()
        took = 0
        failure: Exception | None = None
        for slot in self._write_order:
            store = slot.store
            try:
                peek = getattr(store, "peek", None)
                held = peek(key) if peek is not None else store.get(key)
                if held is None or held.created_s != created_s:
                    continue
                # its own tenant, tags and adapter: an invalidation of any of them covers it
                if self.invalidations.covers(key, held) or held.endorsements >= endorsements:
                    continue
                endorse = getattr(store, "endorse", None)
                if endorse is not None:  # re-read in place: replaced since, it takes none
                    took += endorse(key, created_s, endorsements) > 0
                    continue
                merge = getattr(store, "merge", None)
                if merge is not None:  # L3: set only while it still holds that answer
                    took += bool(merge(key, functools.partial(_endorsed, created_s, endorsements)))
                    continue
                store.put(key, dataclasses.replace(held, endorsements=endorsements))
                took += 1
            except Exception as exc:  # noqa: BLE001 - re-raised below: the others still take it
                failure = failure or exc
        if failure is not None and not took:
            raise failure
        return took

    def merge_side(
        self,
        key: str,
        merge: Callable[[str | None], str | None],
        tenant_scope: str,
        created_s: float | None = None,
    ) -> int:
        """Write `key`'s side record (tiercache.semantic.side_entries: a floor, a trust record)
        in each shared tier as `merge` makes it of the text that tier holds now (None: none
        usable there: absent, undecodable, expired, of another tenant, or covered by an
        invalidation this process knows of), read and written as one step per tier (LMDB: one
        write transaction; Redis: a compare-and-set, tried again when another writer came in
        between; `merge` may be called more than once), so two processes or replicas merging
        at once both keep their change, where a read, then a `put`, kept the last writer's.
        `merge` returning None leaves that tier as it is. Not L1: side records are never read
        from it. The record belongs to `tenant_scope` and is stamped `created_s` (default now:
        an invalidation issued since covers it, and it is then not written), or, when it
        merges a tier's record made before that, back-dated towards that record by at most
        SIDE_LAG_S, or a quarter of `default_ttl_s` when that is less (what it carries is
        older: a tenant invalidation issued that long before, and heard here only after the
        merge, covers it; a record never outlives the horizon `default_ttl_s` after its
        stamp, so no forgotten watermark brings it back). How many tiers took it; the first
        failure is raised when every tier failed (one that needed no change, a floor already
        as high, answered)."""
        self._catch_up()
        stamped = self._clock() if created_s is None else created_s
        invalidations = self.invalidations

        def make(held: CacheEntry | None) -> CacheEntry | None:
            usable = (
                held is not None
                and not held.expired(self._clock())
                and held.tenant_scope in ("", tenant_scope)
                and not invalidations.covers(key, held)
            )
            text = merge(held.text if usable and held is not None else None)
            if text is None:
                return None
            entry = CacheEntry(
                text=text, created_s=stamped, ttl_s=self.default_ttl_s, tenant_scope=tenant_scope
            )
            if usable and held is not None and held.created_s < stamped:
                # It carries what `held` held: back-dated towards it, so an invalidation issued
                # up to SIDE_LAG_S before and not yet heard here covers it when it is; not
                # further (a record back-dated to its first making aged out `default_ttl_s`
                # after it however often it was raised, and one written under a lowered ttl_s
                # was expired as written), and never to a time at which it is already expired
                lag = (
                    SIDE_LAG_S
                    if self.default_ttl_s <= 0
                    else min(
                        SIDE_LAG_S,
                        self.default_ttl_s / 4,  # it lives 3/4 of ttl_s after a raise
                    )
                )
                back = dataclasses.replace(entry, created_s=max(held.created_s, stamped - lag))
                if not back.expired(self._clock()):
                    entry = back
            return None if invalidations.covers(key, entry) else entry

        took = answered = 0
        failure: Exception | None = None
        for slot in self._write_order:
            if slot.reach is Reach.PROCESS:
                continue
            store = slot.store
            try:
                merge_in = getattr(store, "merge", None)
                if merge_in is not None:
                    took += bool(merge_in(key, make))
                else:
                    peek = getattr(store, "peek", None)  # a store without one: read, then put
                    entry = make(peek(key) if peek is not None else store.get(key))
                    if entry is not None:
                        store.put(key, entry)
                        took += 1
                answered += 1
            except Exception as exc:  # noqa: BLE001 - re-raised below: the others still take it
                failure = failure or exc
                if _SIDE_FAILURES_LOG.ready():  # raised only when every tier failed: said here
                    log.warning(
                        "a side record (%s) was not merged into %s: %s (%d such failures not "
                        "logged)",
                        key[:12],
                        slot.tier.name,
                        exc,
                        _SIDE_FAILURES_LOG.suppressed,
                    )
        if failure is not None and not answered:
            raise failure
        return took

    def note_invalidations(self) -> None:
        """Note the host's invalidations recorded since the last read (as every read does
        first): for readers of the stores that go around `get` (side records)."""
        self._catch_up()

    def _catch_up(self) -> None:
        if self.host_marks is None:
            return
        try:
            self.host_marks.catch_up(self.invalidations)
        except Exception:  # noqa: BLE001 - the tiers still answer; logged for the operator
            now = time.monotonic()
            if now - self._catch_up_logged_s >= 60.0:  # once a minute, not on every read
                self._catch_up_logged_s = now
                log.exception("reading the host's invalidation log failed")

    @staticmethod
    def _drop(tier: Tier, store: Store, key: str, seen: CacheEntry) -> None:
        """Drop the unusable entry `seen` read from `store`, unless another process replaced
        it meanwhile (a fresh answer written between this read and the drop stays)."""
        try:
            store.delete_if_same(key, seen)
        except Exception:  # noqa: BLE001 - it stays a miss; the next read tries again
            log.exception("dropping %s from %s failed", key, tier.value)

    def delete(self, key: str) -> bool:
        removed = False
        for _, store in self._stores:
            removed = store.delete(key) or removed
        return removed

    def stores(self) -> list[tuple[Tier, Store]]:
        """(tier, store) pairs, nearest first (a new list: callers may keep or change it)."""
        return list(self._stores)

    def store(self, tier: Tier) -> Store | None:
        """The store of `tier`; None when this cache has no such tier."""
        return next((t.store for t in self.tiers if t.tier is tier), None)

    def local_stores(self) -> list[tuple[Tier, Store]]:
        """The tiers of this host (L1, L2): what an invalidation message makes each process drop."""
        return [(t.tier, t.store) for t in self.tiers if t.reach is not Reach.FLEET]

    def close(self) -> None:
        if self._due is not None and self._checker is not None:
            with contextlib.suppress(queue.Full):
                self._due.put(None, timeout=1.0)
            self._checker.join(timeout=5.0)
        for item in self.background:
            item.close()
        for _, store in self._stores:
            store.close()
        if self.host_marks is not None:
            self.host_marks.close()


def _endorsed(created_s: float, endorsements: int, held: CacheEntry | None) -> CacheEntry | None:
    """`held` with `endorsements` `good` verdicts when it is the answer made at `created_s` and
    has fewer; None (nothing written) otherwise: a merge's step for `endorse_entry`."""
    if held is None or held.created_s != created_s or held.endorsements >= endorsements:
        return None
    return dataclasses.replace(held, endorsements=endorsements)
