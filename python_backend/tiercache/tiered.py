"""The exact cache: L1 (this process) in front of L2 (shared on the host), read-through.

A read tries L1, then L2; an L2 hit is promoted into L1. A write goes to L2 first (the tier other
processes see), then L1. Expiry is checked on every read with the injected clock, so an expired
entry is a miss in every tier and is dropped where it was found.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from tiercache.codec import CacheEntry
from tiercache.stores import Store


class Tier(str, Enum):
    L1 = "l1"
    L2 = "l2"


@dataclass(frozen=True, slots=True)
class Lookup:
    entry: CacheEntry
    tier: Tier


class TieredCache:
    """Either tier may be None: the llm stage writes through L2 only, since its own L1 would
    never be read (lookups happen in the prompt_cache process, whose L1 fills on the first L2 hit).
    """

    def __init__(
        self,
        l1: Store | None,
        l2: Store | None,
        clock: Callable[[], float] = time.time,
        default_ttl_s: float = 0.0,
    ) -> None:
        self.l1 = l1
        self.l2 = l2
        self._clock = clock
        self.default_ttl_s = default_ttl_s

    def get(self, key: str) -> Lookup | None:
        now = self._clock()
        if self.l1 is not None:
            entry = self.l1.get(key)
            if entry is not None:
                if not entry.expired(now):
                    return Lookup(entry, Tier.L1)
                self.l1.delete(key)
        if self.l2 is None:
            return None
        entry = self.l2.get(key)
        if entry is None:
            return None
        if entry.expired(now):
            self.l2.delete(key)
            return None
        if self.l1 is not None:
            self.l1.put(key, entry)
        return Lookup(entry, Tier.L2)

    def put(
        self,
        key: str,
        text: str,
        *,
        ttl_s: float | None = None,
        finish_reason: str = "stop",
        generated_tokens: int = 0,
    ) -> CacheEntry:
        entry = CacheEntry(
            text=text,
            created_s=self._clock(),
            ttl_s=self.default_ttl_s if ttl_s is None else ttl_s,
            finish_reason=finish_reason,
            generated_tokens=generated_tokens,
        )
        if self.l2 is not None:
            self.l2.put(key, entry)
        if self.l1 is not None:
            self.l1.put(key, entry)
        return entry

    def delete(self, key: str) -> bool:
        removed = False
        for _, store in self.stores():
            removed = store.delete(key) or removed
        return removed

    def stores(self) -> list[tuple[Tier, Store]]:
        return [(t, s) for t, s in ((Tier.L1, self.l1), (Tier.L2, self.l2)) if s is not None]

    def close(self) -> None:
        for _, store in self.stores():
            store.close()
