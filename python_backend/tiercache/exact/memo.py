"""A bounded memo for pure functions on the exact-hit path (canonical requests, digests, sealed
envelopes): a repeated request skips the JSON encodings, the SHA-256 and the HMAC it would
otherwise pay again on every hit.

A dict cleared when full rather than an LRU (cachetools, functools.lru_cache): nothing is
updated on a hit, and the hot keys come back after a clear within one request each. Keys are
the functions' whole inputs, so a memoized value is always the one the function would return;
values too large to be worth keeping (`MEMO_MAX_CHARS`) are not memoized.

Full means `MEMO_ENTRIES` entries or `MEMO_CHARS` characters of the texts they hold (each
caller says what an entry holds), whichever comes first: a workload's few thousand hot
prompts stay memoized (1,024 entries were cleared every 1,024 distinct requests, so 2,048 hot
prompts never hit), while a memo of long texts holds at most MEMO_CHARS characters of them
(what its callers count: the texts of the inputs as received and of what was computed from
them, padding included; objects add about 1 KB an entry). Measured under
tracemalloc (the hit path's stand-in ensemble, 4,096 distinct 90-character prompts, each
asked once after its answer was cached): prompt_cache's three memos and llm's held 15 MiB in
all, about 3.7 KB per hot prompt; the memos' counts then stood at 0.8 M characters (the
request memos) and 3.3 M (the sealed envelopes, llm's hits), under MEMO_CHARS."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

MEMO_ENTRIES = 4096  # per memo
MEMO_CHARS = 4 << 20  # per memo: the characters its entries hold (4 to 16 MiB of text)
MEMO_MAX_CHARS = 4096  # a longer text is not memoized


def worth_keeping(text: str, envelope: bytes | None = None) -> bool:
    """Whether an exact hit's memo entry keyed by its answer `text` and sealed `envelope` is
    small enough to keep (`MEMO_MAX_CHARS`; an envelope counts a quarter per byte)."""
    return max(len(text), len(envelope or b"") // 4) <= MEMO_MAX_CHARS


class Memo(Generic[V]):
    """Values by key, at most `max_entries` of them holding at most `max_chars` characters
    of text (all forgotten when a new key finds it full)."""

    __slots__ = ("_chars", "_data", "_lock", "_max", "_max_chars")

    def __init__(self, max_entries: int = MEMO_ENTRIES, max_chars: int = MEMO_CHARS) -> None:
        if max_entries < 1:
            raise ValueError("a memo holds at least one entry")
        if max_chars < MEMO_MAX_CHARS:
            raise ValueError(f"a memo holds at least {MEMO_MAX_CHARS} characters")
        self._data: dict[Hashable, V] = {}
        self._max = max_entries
        self._max_chars = max_chars
        self._chars = 0
        self._lock = threading.Lock()  # puts only (a get reads the dict as it is)

    def get(self, key: Hashable) -> V | None:
        return self._data.get(key)

    def put(self, key: Hashable, value: V, chars: int = 0) -> V:
        """Remember `value` under `key`, an entry whose key and value hold `chars` characters
        of text (more than `max_chars`: not kept); returns it. A key put again replaces its
        value and keeps the count it was first put with (a memoized function's value for a key
        never changes; a caller that replaces one, prompt_cache's sealed hit of a new issue
        step, puts a value of the same size)."""
        if chars > self._max_chars:
            return value
        with self._lock:
            data = self._data
            if key not in data:
                if len(data) >= self._max or self._chars + chars > self._max_chars:
                    data.clear()
                    self._chars = 0
                self._chars += chars
            data[key] = value
        return value

    @property
    def chars(self) -> int:
        """The characters of text its entries hold (as their callers counted them)."""
        return self._chars

    def __len__(self) -> int:
        return len(self._data)
