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
than the admission itself.

A policy belongs to one store (it is stateful) and is not thread-safe: the store calls it under
its own lock, or from its single thread. Stores take their policy as a constructor argument, so
another one (frequency- or value-aware) plugs in without touching them; tests/unit/test_eviction.py
holds the contract suite every policy passes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

SkipKey = Callable[[K], bool]
"""key -> True when the store cannot evict it now (pinned, in use, being loaded)."""


class EvictionPolicy(Protocol[K]):
    """Ranks a store's keys for eviction. Told every admission, read and removal; changes
    nothing by itself."""

    def admit(self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0) -> None:
        """`key` was stored, or its value replaced (the arguments describe the new value)."""
        ...

    def access(self, key: K) -> None:
        """`key` was read or used. On every hit, so O(1) and cheap. An unknown key is ignored."""
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

    def admit(self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def access(self, key: K) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:
            pass

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

    def admit(self, key: K, size: int = 1, *, created_s: float = 0.0, cost_s: float = 0.0) -> None:
        self._entries.pop(key, None)  # a replaced value ranks among ties as a new admission
        self._entries[key] = (created_s, size)

    def access(self, key: K) -> None:
        pass

    def remove(self, key: K) -> None:
        self._entries.pop(key, None)

    def nominate(self, count: int = 1, size: int = 0, skip: SkipKey[K] | None = None) -> list[K]:
        ranked = sorted(self._entries.items(), key=lambda item: item[1][0])  # stable: ties stay
        return take_victims(((key, key_size) for key, (_, key_size) in ranked), count, size, skip)

    def clear(self) -> None:
        self._entries.clear()
