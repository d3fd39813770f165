"""A bounded memo for pure functions on the exact-hit path (canonical requests, digests, sealed
envelopes): a repeated request skips the JSON encodings, the SHA-256 and the HMAC it would
otherwise pay again on every hit.

Two generations of a dict rather than an LRU (cachetools, functools.lru_cache): nothing is
updated on a hit in the current generation. When a new key finds the current generation full,
it becomes the old one (the generation before it is forgotten) and a new one starts; a key found
only in the old generation is moved to the current one. So a key asked for since the last turn
survives the next one: a hot set of up to a generation's entries stays memoized whatever passes
through beside it (keys that are asked for once, the entries of an issue step gone by: llm's
decoded hits are keyed by their envelope, which names its issue step), where a dict cleared
when full forgot the hot keys with the cold ones at every clear, and a hot set a little larger
than it was forgotten all the time. Keys are the functions' whole inputs, so a memoized value
is always the one the function would return; values too large to be worth keeping
(`MEMO_MAX_CHARS`) are not memoized.

A generation is full at `MEMO_ENTRIES` entries or `MEMO_CHARS` characters of the texts its
entries hold (each caller says what an entry holds), whichever comes first: a workload's few
thousand hot prompts stay memoized (1,024 entries were cleared every 1,024 distinct requests, so
2,048 hot prompts never hit), while a memo of long texts holds at most 2 x MEMO_CHARS characters
of them in its two generations (what its callers count: the texts of the inputs as received and
of what was computed from them, padding included; objects add about 1 KB an entry). Two
generations hold at most twice what the one dict did, and only once more distinct keys than a
generation holds have come. Measured under tracemalloc with one generation (the hit path's
stand-in ensemble, 4,096 distinct 90-character prompts, each asked once after its answer was
cached): prompt_cache's three memos and llm's held 15 MiB in all, about 3.7 KB per hot prompt;
the memos' counts then stood at 0.8 M characters (the request memos) and 3.3 M (the sealed
envelopes, llm's hits)."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

MEMO_ENTRIES = 4096  # per generation of a memo
MEMO_CHARS = 4 << 20  # per generation: the characters its entries hold (4 to 16 MiB of text)
MEMO_MAX_CHARS = 4096  # a longer text is not memoized


def worth_keeping(text: str, envelope: bytes | None = None) -> bool:
    """Whether an exact hit's memo entry keyed by its answer `text` and sealed `envelope` is
    small enough to keep (`MEMO_MAX_CHARS`; an envelope counts a quarter per byte)."""
    return max(len(text), len(envelope or b"") // 4) <= MEMO_MAX_CHARS


class Memo(Generic[V]):
    """Values by key in two generations, each of at most `max_entries` entries holding at most
    `max_chars` characters of text (see the module's docstring). Thread-safe: gets read
    without a lock (a get racing a turn finds its key in one generation or the other, or misses:
    a value is recomputed, never wrong); puts, moves and turns take it."""

    __slots__ = (
        "_chars",
        "_data",
        "_lock",
        "_max",
        "_max_chars",
        "_old",
        "_old_chars",
        "_old_sizes",
        "_sizes",
    )

    def __init__(self, max_entries: int = MEMO_ENTRIES, max_chars: int = MEMO_CHARS) -> None:
        if max_entries < 1:
            raise ValueError("a memo holds at least one entry")
        if max_chars < MEMO_MAX_CHARS:
            raise ValueError(f"a memo holds at least {MEMO_MAX_CHARS} characters")
        # the current generation: key -> value, and key -> the characters its entry holds
        # (apart: a hit reads the value alone, as from one dict); then the old generation's
        self._data: dict[Hashable, V] = {}
        self._sizes: dict[Hashable, int] = {}
        self._old: dict[Hashable, V] = {}
        self._old_sizes: dict[Hashable, int] = {}
        self._max = max_entries
        self._max_chars = max_chars
        self._chars = 0
        self._old_chars = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        value = self._data.get(key)
        if value is not None:
            return value
        value = self._old.get(key)
        if value is None:
            return None
        with self._lock:  # asked for again: into the current generation
            # read again under the lock: a turn since may have forgotten it, or a put since
            # may hold a newer value in the current generation
            held = self._old.get(key)
            chars = self._old_sizes.get(key)
            if held is not None and chars is not None and key not in self._data:
                self._add(key, held, chars)
        return value

    def put(self, key: Hashable, value: V, chars: int = 0) -> V:
        """Remember `value` under `key`, an entry whose key and value hold `chars` characters
        of text (more than a generation holds: not kept); returns it. A key put again replaces
        its value and keeps the count it was first put with (a memoized function's value for a
        key never changes; a caller that replaces one, prompt_cache's sealed hit of a new issue
        step, puts a value of the same size)."""
        if chars > self._max_chars:
            return value
        with self._lock:
            if key in self._data:
                self._data[key] = value
            else:
                self._add(key, value, chars)
        return value

    def _add(self, key: Hashable, value: V, chars: int) -> None:
        """`key`, not in the current generation, put there (under the lock), after a turn
        when it is full."""
        if len(self._data) >= self._max or self._chars + chars > self._max_chars:
            # the current generation becomes the old one; the one before it is forgotten
            self._old, self._old_sizes, self._old_chars = self._data, self._sizes, self._chars
            self._data, self._sizes, self._chars = {}, {}, 0
        self._chars += chars
        self._sizes[key] = chars
        self._data[key] = value

    @property
    def chars(self) -> int:
        """The characters of text its entries hold (as their callers counted them), in both
        generations (an entry moved to the current one counts in each until the next turn)."""
        return self._chars + self._old_chars

    def __len__(self) -> int:
        """The entries of both generations (an entry moved counts in each until the next
        turn)."""
        return len(self._data) + len(self._old)
