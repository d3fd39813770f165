"""Eviction policies: which entries a bounded structure gives up first.

One protocol for every bounded structure of the package: the exact cache's L1 and L2
(`tiercache.exact.stores`), the prefix KV block pool (`tiercache.engine.kv_cache`), the engine's
adapter slots (`tiercache.engine.adapters`) and lora_cache's residency tiers
(`tiercache.lora.residency`). Store and policy are separate: the store tells its
policy what it admits, reads and removes, and asks it for victims when it needs room; the policy
only ranks keys. The store evicts the victims itself (and reports each with `remove`), and keeps
what it must not lose: pinned entries are the store's business, passed to `nominate` as `skip`,
never state the policy keeps.

What a store knows of an entry comes with its admission: `size` in the store's own unit (what
evicting it frees: bytes, or 1 per slot), `created_s` (when its value was made, on the store's
clock; 0.0 when unknown: for age-ordered policies) and `cost_s` (the seconds the store spent
making or fetching it; 0.0 when unknown: for value-aware policies). Plain arguments rather than a
value object: L1 admits on every write, and building a frozen dataclass there would cost more
than the admission itself. `group` is the store's class of the entry (0 when it has one kind):
L1 groups answers by how they were made (greedy or sampled, `tiercache.exact.stores.answer_group`);
a value-aware policy learns how often each group is hit after admission and weighs new entries
by it, the others ignore it.

A policy belongs to one store (it is stateful) and is not thread-safe: the store calls it under
its own lock, or from its single thread. Stores take their policy as a constructor argument, so
another one (frequency- or value-aware) plugs in without touching them; tests/unit/test_eviction.py
holds the contract suite every policy passes.
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from tiercache.frequency_sketch import FrequencySketch, sketch_bytes

K = TypeVar("K", bound=Hashable)

log = logging.getLogger(__name__)

MAX_COST_S = 86_400.0  # a cost above a day counts as a day (a broken or hostile figure)


class KnownCosts:
    """The mean of the known costs seen lately (both halve every `window` of them), for what an
    unknown cost (0.0) counts as; a known cost is capped at `MAX_COST_S`. Not thread-safe."""

    __slots__ = ("_count", "_sum", "_window")

    def __init__(self, window: float) -> None:
        self._window = window
        self._sum = self._count = 0.0

    def resolve(self, cost_s: float, default: float) -> float:
        """`cost_s` capped, or the mean known (`default` when none is known) if it is unknown."""
        if cost_s > 0.0:
            return min(cost_s, MAX_COST_S)
        return self._sum / self._count if self._count else default

    def add(self, cost_s: float) -> float:
        """Count `cost_s` if known; what it counts as (`resolve`, default 1.0)."""
        if cost_s > 0.0:
            cost_s = min(cost_s, MAX_COST_S)
            self._sum += cost_s
            self._count += 1.0
            if self._count > self._window:
                self._sum *= 0.5
                self._count *= 0.5
            return cost_s
        return self.resolve(cost_s, 1.0)

    def clear(self) -> None:
        self._sum = self._count = 0.0


SkipKey = Callable[[K], bool]
"""key -> True when the store cannot evict it now (pinned, in use, being loaded)."""


class EvictionPolicy(Protocol[K]):
    """Ranks a store's keys for eviction. Told every admission, read and removal; changes
    nothing by itself."""

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        """`key` was stored, or its value replaced (the arguments describe the new value)."""
        ...

    def access(self, key: K) -> None:
        """`key` was read or used. On every hit, so cheap (O(1), or O(log n) for a value order).
        An unknown key is not admitted by it (a frequency-aware policy still counts the request)."""
        ...

    def endorse(self, key: K, count: int) -> None:
        """`count` more `good` verdicts on the held `key`'s value (tiercache.feedback): each
        ranks it as one more request would, for as long as that value is held (an admission
        or removal forgets them; they are not reads, so they prove nothing about how often
        such keys are hit). An unknown key is ignored."""
        ...

    def remove(self, key: K) -> None:
        """`key` left the store (deleted, evicted, expired, dropped). An unknown key is ignored:
        stores report removals without checking first."""
        ...

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        """Victims, the first to evict first: the shortest run of this policy's order that holds
        at least `count` keys and keys whose sizes add up to at least `size`, never a key `skip`
        accepts. Best effort: fewer only when the admitted keys not skipped run out. Removes
        nothing: the store evicts what it takes and reports each with `remove`."""
        ...

    def clear(self) -> None:
        """Forget every key (the store was emptied, or rebuilds the policy's view)."""
        ...


def take_victims(
    ranked: Iterable[tuple[K, int]], count: int, size: int, skip: SkipKey[K] | None
) -> list[K]:
    """The shortest run of `ranked` (key, size) pairs, best victim first, that holds `count` keys
    and `size` units, leaving out skipped keys: `nominate` for policies that can list their order.
    Stops reading `ranked` as soon as it has enough, so a lazy order is walked only that far."""
    chosen: list[K] = []
    if count <= 0 and size <= 0:
        return chosen
    total = 0
    for key, key_size in ranked:
        if skip is not None and skip(key):
            continue
        chosen.append(key)
        total += key_size
        if len(chosen) >= count and total >= size:
            break
    return chosen


class LruPolicy(Generic[K]):
    """Least recently used first: an admission or an access moves a key to the back.

    An OrderedDict of key -> size: admit, access and remove are O(1) (`move_to_end`, no
    allocation on a hit). `nominate` walks from the front, past skipped keys, so its cost is the
    victims plus the skipped keys in front of them.
    """

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[K, int] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._order)

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key: K) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:
            pass

    def endorse(self, key: K, count: int) -> None:
        if count > 0:
            self.access(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        return take_victims(self._order.items(), count, size, skip)

    def clear(self) -> None:
        self._order.clear()


class OldestFirstPolicy(Generic[K]):
    """Oldest `created_s` first, ties in admission order; reads change nothing (FIFO by the age
    of the value, not of the admission: a value copied in from another tier keeps its age).

    For stores whose reads are not recorded: L2, read by every process of the host, none of which
    writes on a read. `nominate` sorts every key, O(n log n): sized for L2's batch evictions (one
    call evicts a fraction of the entries).
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[K, tuple[float, int]] = {}  # key -> (created_s, size), admission order

    def __len__(self) -> int:
        return len(self._entries)

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        self._entries.pop(key, None)  # a replaced value ranks among ties as a new admission
        self._entries[key] = (created_s, size)

    def access(self, key: K) -> None:
        pass

    def endorse(self, key: K, count: int) -> None:
        pass

    def remove(self, key: K) -> None:
        self._entries.pop(key, None)

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        ranked = sorted(self._entries.items(), key=lambda item: item[1][0])  # stable: ties stay
        return take_victims(((key, key_size) for key, (_, key_size) in ranked), count, size, skip)

    def clear(self) -> None:
        self._entries.clear()


class GreedyDualFrequencyPolicy(Generic[K]):
    """Lowest value first, where a key's value is the cache's inflation level when it was last
    used plus its recent request count (from a TinyLFU sketch that remembers keys long after
    they leave) times its cost per unit of size: GreedyDual-Size-Frequency (Cherkasova, HP Labs
    1998) with TinyLFU's aging sketch as the frequency.

    Why it suits the prefix KV pool: a block asked for again is worth more than a new one
    (Mooncake's conversation trace: 24 % of new blocks are used again, 42 % of blocks used twice
    are used a third time), yet a pool large enough to hold a block until its next use should
    keep recency's order; the inflation level `L` (set to each victim's value as it goes) ages
    every entry at the rate the pool turns over, so frequency weighs most when the pool is small.
    On that trace it gives 1.35x LRU's block hit ratio at 4,000 blocks (1.53x with the admission
    prior below) and never less than LRU from 500 to 30,000 (`tiercache simulate-kv`,
    docs/kv_reuse.md). Cost and size come with admission
    (`cost_s`, `size`): an answer that took 20 s to make outranks a 0.3 s one of the same size and
    frequency. An unknown cost (0.0) counts as the mean of the known ones admitted lately (the
    last `ADMISSION_WINDOW` or so), or 1 when none is known: a warmed answer with no recorded
    cost ranks as an average one, and a store that never knows costs (the KV pool) ranks by
    frequency and size alone.

    Admission: a key the sketch has never seen (a one-off, most of the time) starts with its
    weight discounted by how much less often such keys are hit while held than keys seen
    before: the ratio of the two classes' hits per admission, learned online over the last
    `ADMISSION_WINDOW` admissions of each class, at most 1 and at least `MIN_DISCOUNT`, kept
    while the key is held. A small pool, where one-offs rarely live to their second use,
    discounts them and keeps what is asked for again; a large one, where they often do, barely
    does. It is TinyLFU's doorkeeper turned into a prior rather than a gate (a gate refused
    one-offs that were worth keeping at 10,000 to 30,000 blocks). On the conversation trace it
    raised 4,000 blocks from 1.35x to 1.53x LRU and 10,000 fell from 1.10x to 1.06x
    (docs/kv_reuse.md).

    Groups: the same learning per `group` the store gives at admission (L1: greedy or sampled
    answers). A group whose entries are hit less often per admission than the best group's
    starts with its weight times the ratio of the two rates (at least `MIN_DISCOUNT`, kept while
    held), once both have `GROUP_EVIDENCE` admissions; until then, and for a store with one
    group, it is 1. So answers of sampled requests, which come back only with the same seed,
    decay faster when, and as much as, the traffic shows they are asked for less.

    `capacity`: the number of keys the store holds when full, sizing the sketch; 0 (unknown)
    starts small and builds a sketch four times larger each time the live keys outgrow it
    (the live keys keep their counts in the new one; keys no longer held are forgotten), while
    it stays within `limit_sketch`'s bytes (a sketch costs about 256 bytes per key of capacity:
    unbounded, a store of many small entries held as much again in its sketch).
    Heap with lazy deletion: admit/access push an entry (O(log n)), stale entries are skipped and
    the heap is rebuilt when they outnumber the live ones; `nominate` pops and pushes back.
    """

    __slots__ = (
        "_admissions",
        "_capacity",
        "_cost",
        "_endorsed",
        "_entries",
        "_groups",
        "_heap",
        "_hits",
        "_inflation",
        "_max_sketch_bytes",
        "_offered",
        "_pending",
        "_sequence",
        "_sketch",
        "_unproven",
    )

    _START_CAPACITY = 1024
    # Accesses are recorded and applied together, in order, this many at a time or before
    # anything reads or changes the policy (`_apply`): each one's sketch count and re-ranking
    # are what they would have been at once (nothing else ran in between), and a hit pays a
    # list append. Applied one by one, the access was the hit path's costliest step with the
    # CPU caches cold (35 us in process after 16 MiB were read, the sketch's count 26 of it;
    # 5 warm): a batch runs warm after its first.
    ACCESS_BATCH = 128
    # what its own structures hold per key beyond an LRU's (a store adds it to each entry's
    # size: `entry_overhead_bytes`): the ranked tuple, up to two heap items (the heap is
    # rebuilt past twice the live keys; an item re-ranked by a read holds that read's copy of
    # the key), the unproven record. Under tracemalloc on CPython 3.11, an L1 of 20,000 short
    # answers, a third of them read three times with keys made afresh, the sketch aside (the
    # store bounds it apart): 973 B held a key under GDSF against 527 under LRU; uncounted,
    # L1 held 2.0 times what it counted, against LRU's 1.09
    entry_overhead_bytes = 448
    ADMISSION_WINDOW = 10_000  # admissions per class before both counts halve
    MIN_DISCOUNT = 0.5
    GROUP_EVIDENCE = 100  # admissions a group needs before its rate discounts or is compared

    def __init__(self, capacity: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 keys, got {capacity}")
        self._capacity = capacity
        self._sketch = FrequencySketch(capacity or self._START_CAPACITY)
        self._max_sketch_bytes: int | None = None  # `limit_sketch`; None: unbounded
        self._inflation = 0.0
        self._sequence = 0
        # key -> (value, sequence, size, weight): weight is cost per unit of size
        self._entries: dict[K, tuple[float, int, int, float]] = {}
        self._heap: list[tuple[float, int, K]] = []
        # the last nomination's keys -> their sequence then: a removal of one of them, unchanged
        # since, is an eviction (a listing caller that deletes a listed key counts as evicting it)
        self._offered: dict[K, int] = {}
        # admission classes, 0: never seen before, 1: seen; hits while held and admissions
        self._hits = [1.0, 1.0]
        self._admissions = [1.0, 1.0]
        # per group: [hits while held, admissions] (windowed as the classes are)
        self._groups: dict[int, list[float]] = {}
        self._cost = KnownCosts(self.ADMISSION_WINDOW)  # known costs per admission, windowed
        # held keys not hit yet -> (their admission class, their group)
        self._unproven: dict[K, tuple[int, int]] = {}
        # held keys -> the `good` verdicts on their value, added to their frequency (kept out
        # of the sketch, which remembers a key after it leaves: counted there at each
        # admission, an endorsed answer gained them again every time it came back)
        self._endorsed: dict[K, int] = {}
        self._pending: list[K] = []  # accesses not applied yet, oldest first (`_apply`)

    def _apply(self) -> None:
        """Apply the recorded accesses, in the order they came. One that fails (out of memory
        in a heap push) is lost, logged, and the rest applied: the call that applies them
        (a removal, an admission) must still do its own work, as it did when each access was
        applied by the read that made it."""
        pending, self._pending = self._pending, []
        for key in pending:
            try:
                self._access_now(key)
            except Exception:  # noqa: BLE001 - one access's rank, never the caller's work
                log.exception("applying a recorded access failed; that access is not counted")

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def inflation(self) -> float:
        """The value of the last key evicted (GreedyDual's `L`)."""
        return self._inflation

    def frequency(self, key: K) -> int:
        """The sketch's estimate of recent requests for `key` (kept or not)."""
        if self._pending:
            self._apply()
        return self._sketch.estimate(key)

    def ranked_frequency(self, key: K) -> int:
        """What `key`'s rank counts as its requests: the sketch's estimate and the `good`
        verdicts on its held value."""
        if self._pending:
            self._apply()
        return self._sketch.estimate(key) + self._endorsed.get(key, 0)

    def _rank(self, key: K, frequency: int, size: int, weight: float) -> None:
        value = self._inflation + frequency * weight
        self._offered.pop(key, None)  # re-ranked since it was nominated: no longer that victim
        self._sequence += 1
        self._entries[key] = (value, self._sequence, size, weight)
        heap = self._heap
        heapq.heappush(heap, (value, self._sequence, key))
        if len(heap) > 2 * len(self._entries) + 64:
            self._heap = [(v, s, k) for k, (v, s, _, _) in self._entries.items()]
            heapq.heapify(self._heap)

    @property
    def sketch_bytes(self) -> int:
        """The bytes the frequency sketch holds (beyond the entries' own)."""
        return self._sketch.nbytes

    def limit_sketch(self, max_bytes: int) -> None:
        """Bound a growing sketch (`capacity` 0) to `max_bytes`, never below its starting size:
        it stops growing there, and a larger one is rebuilt at the largest size that fits (the
        live keys keep their counts). A store that gives its budget calls this with its share."""
        if self._pending:
            self._apply()
        self._max_sketch_bytes = max_bytes
        if self._capacity:
            return
        fitting = self._fitting_capacity(self._sketch.capacity)
        if fitting < self._sketch.capacity:
            self._rebuild(fitting)

    def _fitting_capacity(self, at_most: int) -> int:
        """The largest capacity, a power-of-four multiple of the start's and at most
        `at_most`, whose sketch fits the limit (the start's whatever the limit)."""
        capacity = self._START_CAPACITY
        limit = self._max_sketch_bytes
        while capacity * 4 <= at_most and (limit is None or sketch_bytes(capacity * 4) <= limit):
            capacity *= 4
        return capacity

    def _grow(self) -> None:
        if self._capacity or len(self._entries) <= self._sketch.capacity:
            return
        wanted = self._fitting_capacity(self._sketch.capacity * 4)
        if wanted > self._sketch.capacity:
            self._rebuild(wanted)

    def _rebuild(self, capacity: int) -> None:
        old = self._sketch
        self._sketch = FrequencySketch(capacity)
        for key in self._entries:  # the live keys keep their counts; the others are forgotten
            for _ in range(old.estimate(key)):
                self._sketch.add(key)

    def age(self) -> None:
        """Raise the inflation level to the lowest value held, as evicting that key would: for a
        store that evicted in another order (`ShadowChoicePolicy`), so that this order still ages
        as the store turns over."""
        if self._pending:
            self._apply()
        heap, entries = self._heap, self._entries
        while heap:
            value, sequence, key = heap[0]
            entry = entries.get(key)
            if entry is None or entry[1] != sequence:
                heapq.heappop(heap)  # stale
                continue
            self._inflation = max(self._inflation, value)
            return

    def first_sight_discount(self) -> float:
        """What a never-seen key's weight is multiplied by now (see the class docstring); 1.0
        while seen keys show no hits at all (their count halved to nothing over millions of
        admissions never read: the division failed every admission of a new key)."""
        if self._pending:
            self._apply()
        first = self._hits[0] / self._admissions[0]
        seen = self._hits[1] / self._admissions[1]
        if seen <= 0.0:
            return 1.0
        return max(self.MIN_DISCOUNT, min(1.0, first / seen))

    def group_discount(self, group: int) -> float:
        """What a new key's weight in `group` is multiplied by now (see the class docstring)."""
        if self._pending:
            self._apply()
        counts = self._groups.get(group)
        if counts is None or counts[1] < self.GROUP_EVIDENCE or len(self._groups) < 2:
            return 1.0
        best = max(
            hits / admissions
            for hits, admissions in self._groups.values()
            if admissions >= self.GROUP_EVIDENCE
        )
        rate = counts[0] / counts[1]
        return max(self.MIN_DISCOUNT, min(1.0, rate / best)) if best > 0 else 1.0

    def mean_cost(self) -> float:
        """What an unknown cost counts as now: the mean known cost, 1.0 when none is known."""
        return self._cost.resolve(0.0, 1.0)

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        if self._pending:
            self._apply()
        seen = int(self._sketch.estimate(key) > 0)
        self._endorsed.pop(key, None)  # a new value: the old one's verdicts are not its own
        self._unproven[key] = (seen, group)
        admissions = self._admissions
        admissions[seen] += 1.0
        if admissions[seen] > self.ADMISSION_WINDOW:
            admissions[seen] *= 0.5
            self._hits[seen] *= 0.5
        counts = self._groups.get(group)
        if counts is None:
            counts = self._groups[group] = [0.0, 0.0]
        counts[1] += 1.0
        if counts[1] > self.ADMISSION_WINDOW:
            counts[0] *= 0.5
            counts[1] *= 0.5
        cost_s = self._cost.add(cost_s)
        frequency = self._sketch.add(key)
        weight = cost_s / max(size, 1)
        if not seen:
            weight *= self.first_sight_discount()
        if len(self._groups) > 1:
            weight *= self.group_discount(group)
        self._rank(key, frequency, size, weight)
        self._grow()

    def access(self, key: K) -> None:
        pending = self._pending
        pending.append(key)
        if len(pending) >= self.ACCESS_BATCH:
            self._apply()

    def _access_now(self, key: K) -> None:
        frequency = self._sketch.add(key)  # counted kept or not: a miss's request is a request
        proven = self._unproven.pop(key, None)
        if proven is not None:
            self._hits[proven[0]] += 1.0
            self._groups[proven[1]][0] += 1.0
        entry = self._entries.get(key)
        if entry is not None:
            self._rank(key, frequency + self._endorsed.get(key, 0), entry[2], entry[3])

    def endorse(self, key: K, count: int) -> None:
        if self._pending:
            self._apply()
        entry = self._entries.get(key)
        if entry is None or count <= 0:
            return
        endorsed = self._endorsed[key] = self._endorsed.get(key, 0) + count
        self._rank(key, self._sketch.estimate(key) + endorsed, entry[2], entry[3])

    def remove(self, key: K) -> None:
        if self._pending:
            self._apply()
        entry = self._entries.pop(key, None)
        self._unproven.pop(key, None)
        self._endorsed.pop(key, None)
        offered = self._offered.pop(key, None)
        if entry is not None and offered == entry[1]:
            self._inflation = max(self._inflation, entry[0])  # evicted: the level rises to it

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        if self._pending:
            self._apply()
        self._offered = {}
        if count <= 0 and size <= 0:
            return []
        heap, entries = self._heap, self._entries
        popped: list[tuple[float, int, K]] = []
        chosen: list[K] = []
        total = 0
        try:
            while heap and (len(chosen) < count or total < size):
                item = heapq.heappop(heap)
                _value, sequence, key = item
                entry = entries.get(key)
                if entry is None or entry[1] != sequence:
                    continue  # stale
                popped.append(item)
                if skip is not None and skip(key):
                    continue
                chosen.append(key)
                total += entry[2]
                self._offered[key] = sequence
        finally:  # a `skip` that raised left the keys popped so far out of the order for good
            for item in popped:
                heapq.heappush(heap, item)
        return chosen

    def clear(self) -> None:
        self._pending = []  # what they would have changed is all cleared below
        self._entries.clear()
        self._heap.clear()
        self._offered.clear()
        self._unproven.clear()
        self._endorsed.clear()
        self._hits = [1.0, 1.0]
        self._admissions = [1.0, 1.0]
        self._groups.clear()
        self._cost.clear()
        self._sketch.clear()
        self._inflation = 0.0


def _sampled(key: Hashable, one_in: int) -> bool:
    """Whether `key` is in the 1-in-`one_in` sample (a power of two) the shadows replay: the
    top bits of its hash mixed by Fibonacci hashing, so that sequential keys spread."""
    mixed = (hash(key) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return mixed >> 56 < 256 // one_in


class _Shadow(Generic[K]):
    """A miniature cache replaying the sampled keys' requests under one policy: what it holds
    and whether each request would have hit."""

    __slots__ = ("policy", "sizes", "total")

    def __init__(self, policy: EvictionPolicy[K]) -> None:
        self.policy = policy
        self.sizes: dict[K, int] = {}
        self.total = 0

    def request(self, key: K, size: int, cost_s: float, group: int, budget: int | None) -> bool:
        """One request for `key` (of `size` now): a hit, or a miss that admits it; then evicts
        down to `budget` (None: unbounded, before the store has filled)."""
        held = self.sizes.get(key)
        if held is not None:
            self.policy.access(key)
            if held != size:
                self.policy.admit(key, size, cost_s=cost_s, group=group)
                self.sizes[key] = size
                self.total += size - held
        else:
            self.policy.admit(key, size, cost_s=cost_s, group=group)
            self.sizes[key] = size
            self.total += size
        while budget is not None and self.total > budget:
            victims = self.policy.nominate(1, skip=lambda other: other == key)
            if not victims:
                break
            for victim in victims:
                self.drop(victim)
        return held is not None

    def drop(self, key: K) -> None:
        self.total -= self.sizes.pop(key)
        self.policy.remove(key)

    def clear(self) -> None:
        self.policy.clear()
        self.sizes.clear()
        self.total = 0


class ShadowChoicePolicy(Generic[K]):
    """Recency's order or GDSF's (`GreedyDualFrequencyPolicy`), whichever a miniature of each
    would have hit more often lately.

    GDSF wins where the pool turns over faster than keys come back (it keeps what is asked for
    again); where most of the live working set fits, counting uses can keep the keys of work
    that has ended (a session's early KV blocks, used on every turn) over those still in use,
    and recency wins (a generated trace, docs/kv_reuse.md). Both orders are kept for every key;
    two shadow caches, LRU and GDSF, replay the requests of a 1-in-`SAMPLE` sample of the keys
    the store holds, at that fraction of the store's size (miniature simulation: Waldspurger et
    al., USENIX ATC 2017; a store too small for shadows of `SHADOW_KEYS` keys samples more, down
    to every key), their hits counted with a weight that halves every `HORIZON` shadow
    capacities of sampled requests. The store evicts in GDSF's order from when GDSF's shadow
    leads LRU's by more than `MARGIN` until it no longer leads, in LRU's otherwise. While LRU's
    order evicts, GDSF's inflation level still rises to its own lowest value at each eviction,
    so its order ages as the store turns over. The shadows are sized after the store (the bytes
    its policy holds) at each request; the sample is chosen at each nomination, thinned in place
    as the store grows (the samples nest) and started over if it shrinks below half its floor.
    Every admission and access of a held key is a request, as the KV block pool tells its
    policy (once per request that uses a block); the answer tiers, which tell theirs a miss
    twice, keep GDSF.
    """

    __slots__ = (
        "_capacity",
        "_decay",
        "_gdsf",
        "_lru",
        "_one_in",
        "_score",
        "_shadows",
        "_sized",
        "_sizes",
        "_total",
        "_use",
    )

    SAMPLE = 8  # at most 1 key in SAMPLE (a power of two) ...
    SHADOW_KEYS = 128  # ... and more where the shadows would hold fewer keys than this
    HORIZON = 4.0
    MARGIN = 0.02
    _GDSF, _LRU = 0, 1

    def __init__(self, capacity: int = 0) -> None:
        self._capacity = capacity
        self._gdsf: GreedyDualFrequencyPolicy[K] = GreedyDualFrequencyPolicy(capacity)
        self._lru: LruPolicy[K] = LruPolicy()
        self._one_in = self.SAMPLE
        self._shadows = self._new_shadows()
        self._score = [0.0, 0.0]  # decayed shadow hits: GDSF's, LRU's
        self._sized = False  # the store has filled once (its first nomination)
        self._decay = 1.0  # from the store's size, at each nomination
        self._use = self._LRU
        self._sizes: dict[K, int] = {}
        self._total = 0

    def _new_shadows(self) -> tuple[_Shadow[K], _Shadow[K]]:
        gdsf: GreedyDualFrequencyPolicy[K] = GreedyDualFrequencyPolicy(
            self._capacity // self._one_in
        )
        return _Shadow(gdsf), _Shadow(LruPolicy())

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def order(self) -> str:
        """The order the store evicts in now: `gdsf` or `lru`."""
        return "gdsf" if self._use == self._GDSF else "lru"

    @property
    def sample(self) -> int:
        """The shadows replay 1 key in this many."""
        return self._one_in

    def admit(
        self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0, group: int = 0
    ) -> None:
        self._gdsf.admit(key, size, created_s=created_s, cost_s=cost_s, group=group)
        self._lru.admit(key, size)
        self._total += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        if _sampled(key, self._one_in):
            self._request(key, size, cost_s, group)

    def endorse(self, key: K, count: int) -> None:
        self._gdsf.endorse(key, count)
        self._lru.endorse(key, count)

    def access(self, key: K) -> None:
        self._gdsf.access(key)
        self._lru.access(key)
        size = self._sizes.get(key)
        if size is not None and _sampled(key, self._one_in):
            self._request(key, size, 0.0, 0)

    def _request(self, key: K, size: int, cost_s: float, group: int) -> None:
        budget = max(1, self._total // self._one_in) if self._sized else None
        score, decay = self._score, self._decay
        for i, shadow in enumerate(self._shadows):
            score[i] = score[i] * decay + shadow.request(key, size, cost_s, group, budget)
        gdsf, lru = score
        if self._use == self._LRU:
            if gdsf > lru * (1.0 + self.MARGIN):
                self._use = self._GDSF
        elif gdsf <= lru:
            self._use = self._LRU

    def remove(self, key: K) -> None:
        self._gdsf.remove(key)
        self._lru.remove(key)
        held = self._sizes.pop(key, None)
        if held is None:
            return
        self._total -= held
        if self._use == self._LRU:
            self._gdsf.age()

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        if self._sizes:  # the store is full: the shadows are sized after it
            self._resample(len(self._sizes))
            self._sized = True
            shadow_keys = max(1.0, len(self._sizes) / self._one_in)
            self._decay = 0.5 ** (1.0 / (self.HORIZON * shadow_keys))
        chosen = self._gdsf if self._use == self._GDSF else self._lru
        return chosen.nominate(count, size, skip)

    def _resample(self, keys: int) -> None:
        """The sample for a store of `keys`: at the first nomination the lowest rate that keeps
        the shadows at their floor (started over if it changed); later thinned in place while the
        shadows would keep at least twice their floor at half the rate, and started over at a
        higher rate when they hold under half their floor."""
        one_in = self._one_in
        if not self._sized:
            while one_in > 1 and keys / one_in < self.SHADOW_KEYS:
                one_in //= 2
            if one_in != self._one_in:
                self._one_in = one_in
                self._shadows = self._new_shadows()
                self._score = [0.0, 0.0]
            return
        while one_in < self.SAMPLE and keys / (2 * one_in) >= 2 * self.SHADOW_KEYS:
            one_in *= 2
        if one_in > self._one_in:
            self._one_in = one_in
            for shadow in self._shadows:
                for key in [k for k in shadow.sizes if not _sampled(k, one_in)]:
                    shadow.drop(key)
            return
        if self._one_in > 1 and keys / self._one_in < self.SHADOW_KEYS / 2:
            while one_in > 1 and keys / one_in < self.SHADOW_KEYS:
                one_in //= 2
            self._one_in = one_in
            self._shadows = self._new_shadows()
            self._score = [0.0, 0.0]

    def clear(self) -> None:
        self._gdsf.clear()
        self._lru.clear()
        self._score = [0.0, 0.0]
        self._sized = False
        self._decay = 1.0
        self._use = self._LRU
        self._one_in = self.SAMPLE
        self._shadows = self._new_shadows()
        self._sizes.clear()
        self._total = 0


NAMED_POLICIES: dict[str, Callable[[int], EvictionPolicy[Any]]] = {
    "gdsf": GreedyDualFrequencyPolicy,
    "lru": lambda capacity: LruPolicy(),
    "shadow": ShadowChoicePolicy,
}
"""The policies an operator can name (the engine's `kv_eviction`, `tiercache simulate-kv`):
name -> factory taking the store's capacity in keys (0: unknown; a policy may ignore it)."""


def named_policy(name: str, capacity: int = 0) -> EvictionPolicy[Any]:
    """A fresh policy by its name in `NAMED_POLICIES`; ValueError naming the known ones."""
    try:
        factory = NAMED_POLICIES[name]
    except KeyError:
        known = ", ".join(NAMED_POLICIES)
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None
    return factory(capacity)
