"""What one more byte of a cache would save: a shadow queue of the keys it evicted last.

A cache that evicts tells its `ShadowQueue` the key, its size and what a hit on it saves (engine
seconds: an answer's generation, a KV block's prefill). The queue keeps the most recently
evicted keys up to `max_bytes` of the sizes they had (keys only; the values are gone). A miss
on a key still in the queue is a hit the cache would have had with that many more bytes:
`credit` adds what it would have saved. So `gained_s` over a while, per byte of the queue, is
the cache's hit gradient: the seconds an extra byte saves (Cliffhanger's shadow queues, NSDI
2016, which move memory between slab classes the same way; tiercache.budgets compares it
across caches). Written here (not a library): it is the measurement the controller runs on.

Not thread-safe: the cache that owns it calls it under its own lock (or from its one thread).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

SHADOW_FRACTION = 0.25
"""A cache's shadow spans this fraction of its budget (at least its latest eviction)."""


class ShadowQueue(Generic[K]):
    """See the module docstring. `max_bytes` 0 keeps nothing (and credits nothing)."""

    def __init__(self, max_bytes: int) -> None:
        self._keys: OrderedDict[K, tuple[int, float]] = OrderedDict()  # key -> (size, saves_s)
        self._bytes = 0
        self.max_bytes = max(max_bytes, 0)
        self.gained_s = 0.0  # what the credited hits would have saved (cumulative)
        self.hits = 0  # misses found here (cumulative)

    def add(self, key: K, size: int, saves_s: float) -> None:
        """`key` was just evicted (a newer eviction of the same key replaces the older). The
        latest is kept even when larger than `max_bytes` (alone then): a cache of a few large
        entries, an adapter tier, would otherwise never see a shadow hit."""
        self.discard(key)
        if self.max_bytes <= 0:
            return
        self._keys[key] = (size, max(saves_s, 0.0))
        self._bytes += size
        self._trim()

    def discard(self, key: K) -> None:
        """`key` is cached again, or deleted (an invalidation is not a lost hit)."""
        held = self._keys.pop(key, None)
        if held is not None:
            self._bytes -= held[0]

    def credit(self, key: K, saves_s: float | None = None) -> bool:
        """A miss on `key`: if it is in the queue, count the hit it would have been, saving
        `saves_s` (None: what it was recorded with) and forget it; whether it was there."""
        held = self._keys.pop(key, None)
        if held is None:
            return False
        self._bytes -= held[0]
        self.gained_s += held[1] if saves_s is None else max(saves_s, 0.0)
        self.hits += 1
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> list[K]:
        """The keys it holds, the oldest eviction first."""
        return list(self._keys)

    def resize(self, max_bytes: int) -> None:
        self.max_bytes = max(max_bytes, 0)
        self._trim()

    @property
    def bytes(self) -> int:
        return self._bytes

    def _trim(self) -> None:
        while (
            self._keys
            and self._bytes > self.max_bytes
            and (len(self._keys) > 1 or self.max_bytes <= 0)
        ):
            _, (size, _) = self._keys.popitem(last=False)
            self._bytes -= size


def shadow_bytes(budget_bytes: int) -> int:
    """The shadow span of a cache whose budget is `budget_bytes`: at least 1 byte, so that it
    keeps its latest eviction alone even at a budget of 0 (a budget cut to a floor of 0, its
    shadow keeping nothing, showed no value, and under a total was never given bytes again
    while any other showed some)."""
    return max(int(budget_bytes * SHADOW_FRACTION), 1)
