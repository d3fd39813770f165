"""A bounded memo for pure functions on the exact-hit path (canonical requests, digests, sealed
envelopes): a repeated request skips the JSON encodings, the SHA-256 and the HMAC it would
otherwise pay again on every hit.

A dict cleared when full rather than an LRU (cachetools, functools.lru_cache): nothing is
updated on a hit, and the hot keys come back after a clear within one request each. Keys are
the functions' whole inputs, so a memoized value is always the one the function would return;
values too large to be worth keeping (`MEMO_MAX_CHARS`) are not memoized."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

MEMO_ENTRIES = 1024  # per memo; texts up to MEMO_MAX_CHARS (envelopes 4x): at most ~32 MiB each
MEMO_MAX_CHARS = 4096


def worth_keeping(text: str, envelope: bytes | None = None) -> bool:
    """Whether an exact hit's memo entry keyed by its answer `text` and sealed `envelope` is
    small enough to keep (`MEMO_MAX_CHARS`; an envelope counts a quarter per byte)."""
    return max(len(text), len(envelope or b"") // 4) <= MEMO_MAX_CHARS


class Memo(Generic[V]):
    """Values by key, at most `max_entries` of them (all forgotten when a new key finds it
    full)."""

    __slots__ = ("_data", "_max")

    def __init__(self, max_entries: int = MEMO_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("a memo holds at least one entry")
        self._data: dict[Hashable, V] = {}
        self._max = max_entries

    def get(self, key: Hashable) -> V | None:
        return self._data.get(key)

    def put(self, key: Hashable, value: V) -> V:
        """Remember `value` under `key`; returns it."""
        data = self._data
        if len(data) >= self._max and key not in data:
            data.clear()
        data[key] = value
        return value

    def __len__(self) -> int:
        return len(self._data)
