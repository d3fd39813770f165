"""Exact tiers whose L3 cannot be read, as while Redis is down: every read of it raises (the
strict read `get_or_raise` as the plain one), writes are taken."""

from __future__ import annotations

from pathlib import Path

from tiercache.exact.codec import CacheEntry
from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.vocabulary import Tier


class DownStore(MemoryStore):
    def get(self, key: str) -> CacheEntry | None:
        raise ConnectionError("Redis is down")

    def get_or_raise(self, key: str) -> CacheEntry | None:
        raise ConnectionError("Redis is down")


def tiers_with_l3_down(tmp_path: Path) -> TieredCache:
    """L1 and L2 in `tmp_path` as a stage has them, and an L3 that cannot be read."""
    l2 = LmdbStore(tmp_path / "l2", 1 << 20)
    return TieredCache(
        [(Tier.L1, MemoryStore(1 << 20)), (Tier.L2, l2), (Tier.L3, DownStore(1 << 20))]
    )
