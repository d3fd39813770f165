"""Cache entries and their on-disk encoding.

Layout (little endian): magic `TCE2` | created_s f64 | ttl_s f64 | payload length u32 |
SHA-256 of the header's created_s, ttl_s and length and the payload (32 bytes) | payload (UTF-8
JSON). Any mismatch (magic, length, checksum, JSON) raises `CorruptEntry`; stores turn that into
a miss and drop the entry. `TCE1`, written before 2026-12-06, hashed the payload alone, so a
flipped bit in its created_s could move an entry past every invalidation and expiry; such
entries are still read, their times checked for sense instead (finite, ttl_s not negative,
created_s not more than a day ahead of the clock), until they are written again.

The payload's optional fields (`tags`, `scope`, `adapter`: what invalidation matches on;
`prompt_tokens`) are written only when set and read as empty when absent, so entries written
before they existed still decode.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from dataclasses import dataclass

MAGIC = b"TCE2"
_MAGIC_V1 = b"TCE1"  # read, never written
_HEADER = struct.Struct("<4sddI32s")
_TIMES = struct.Struct("<ddI")  # what TCE2's checksum covers ahead of the payload
# A TCE1 entry claiming a creation further ahead of this host's clock than this is corrupt
MAX_FUTURE_S = 86_400.0
# Fixed per-entry overhead counted in L1 byte budgets, on top of the text's and metadata's
# characters: the LRU's own slots (139 B per entry under tracemalloc), the entry object (96),
# the 64-character key (113) and the headers of the text and scope strings (49 each), on
# CPython 3.11. At 256 an L1 held about 1.5 times its budget in short answers.
ENTRY_OVERHEAD_BYTES = 448
# The most `good` verdicts an entry keeps count of: each weighs as one more request for it in
# L1's order, so one tenant's callers repeating `good` can lift an answer by a few requests'
# worth, not pin it (L1 is shared by every tenant of the process).
MAX_ENDORSEMENTS = 3
# Bounds of what a stored entry may say it cost and was sampled at: a day of generation (a
# larger figure would dominate every eviction value it is averaged into), and a temperature
# well past any a request may ask for (tiercache.exact.request.MAX_TEMPERATURE).
MAX_GENERATION_S = 86_400.0
MAX_STORED_TEMPERATURE = 100.0


class CorruptEntry(ValueError):
    """Stored bytes that do not decode to an entry."""


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One cached answer. `ttl_s` 0 means it never expires.

    `tags`, `tenant_scope` (`tiercache.exact.keys.tenant_scope`) and `adapter` (the adapter
    digest, "" for the base model) are metadata for invalidation (`tiercache.exact.invalidation`);
    they are not part of the key. `created_s` is when the answer's generation started, so an
    invalidation issued while it was generating also covers it.
    """

    text: str
    created_s: float
    ttl_s: float = 0.0
    finish_reason: str = "stop"
    generated_tokens: int = 0
    tags: tuple[str, ...] = ()
    # The generation's prompt tokens (0: unknown, as for a warmed answer); with
    # `generated_tokens`, what a hit reports as its usage.
    prompt_tokens: int = 0
    tenant_scope: str = ""  # stored under the payload name "scope"
    adapter: str = ""
    # The engine's mean token log-probability of the answer (tiercache.exact.confidence); None
    # when unknown (a warmed answer, an engine that does not report it).
    mean_logprob: float | None = None
    # What making it cost and how: the engine call's wall seconds (0.0: unknown, as for a warmed
    # answer) and the request's sampling temperature (0.0: greedy). L1's eviction value
    # (`tiercache.exact.stores.answer_group`, `tiercache.eviction`).
    generation_s: float = 0.0
    temperature: float = 0.0
    # How many `good` verdicts callers gave it (tiercache.feedback; at most MAX_ENDORSEMENTS
    # kept): L1 admits it as asked for that many more times (tiercache.exact.stores).
    endorsements: int = 0

    def expired(self, now_s: float) -> bool:
        return self.ttl_s > 0 and now_s >= self.created_s + self.ttl_s

    def made_for(self, tenant_scope: str, adapter: str) -> bool:
        """Whether this answer was stored for a request of `tenant_scope` and `adapter`
        version: a value under a key is checked against the request before it is served (L2's
        checksum does not cover the key, so a value moved under another one would be served
        as its answer, another tenant's included)."""
        return self.tenant_scope in ("", tenant_scope) and self.adapter == adapter

    @property
    def size_bytes(self) -> int:
        """What this entry costs an in-memory tier (text as UTF-8 plus fixed overhead)."""
        meta = sum(len(t) for t in self.tags) + len(self.tenant_scope) + len(self.adapter)
        return len(self.text.encode("utf-8")) + meta + ENTRY_OVERHEAD_BYTES


def token_accounting(entry: CacheEntry) -> tuple[int, int, int]:
    """What a hit reports of the generation that produced `entry`: its prompt and completion
    tokens, and 1 when it stopped at max_tokens (finish reason `length`), else 0."""
    return (entry.prompt_tokens, entry.generated_tokens, int(entry.finish_reason == "length"))


def encode_entry(entry: CacheEntry) -> bytes:
    fields: dict[str, object] = {
        "text": entry.text,
        "finish_reason": entry.finish_reason,
        "generated_tokens": entry.generated_tokens,
    }
    if entry.mean_logprob is not None:
        fields["mean_logprob"] = entry.mean_logprob
    if entry.tags:
        fields["tags"] = list(entry.tags)
    if entry.tenant_scope:
        fields["scope"] = entry.tenant_scope
    if entry.adapter:
        fields["adapter"] = entry.adapter
    if entry.prompt_tokens:
        fields["prompt_tokens"] = entry.prompt_tokens
    if entry.generation_s > 0.0:  # capped as read back: a longer one is stored as a day
        fields["generation_s"] = min(entry.generation_s, MAX_GENERATION_S)
    if entry.temperature > 0.0:
        fields["temperature"] = entry.temperature
    if entry.endorsements > 0:
        fields["endorsements"] = entry.endorsements
    payload = json.dumps(
        fields,
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    times = _TIMES.pack(entry.created_s, entry.ttl_s, len(payload))
    header = _HEADER.pack(
        MAGIC, entry.created_s, entry.ttl_s, len(payload), hashlib.sha256(times + payload).digest()
    )
    return header + payload


def decode_entry(data: bytes) -> CacheEntry:
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"entry of {len(data)} bytes is shorter than its header")
    magic, created_s, ttl_s, length, checksum = _HEADER.unpack_from(data)
    if magic not in (MAGIC, _MAGIC_V1):
        raise CorruptEntry(f"bad magic {magic!r}")
    payload = bytes(data[_HEADER.size :])
    if len(payload) != length:
        raise CorruptEntry(f"payload has {len(payload)} bytes, header says {length}")
    covered = payload if magic == _MAGIC_V1 else _TIMES.pack(created_s, ttl_s, length) + payload
    if hashlib.sha256(covered).digest() != checksum:
        raise CorruptEntry("checksum mismatch")
    if magic == _MAGIC_V1 and not (
        math.isfinite(created_s)
        and math.isfinite(ttl_s)
        and ttl_s >= 0
        and created_s <= time.time() + MAX_FUTURE_S
    ):
        raise CorruptEntry(f"an old entry's times make no sense: {created_s!r}, {ttl_s!r}")
    try:
        fields = json.loads(payload.decode("utf-8"))
        if not isinstance(fields, dict):
            raise TypeError(f"the payload is a {type(fields).__name__}, not an object")
        tags = fields.get("tags", [])
        if not isinstance(tags, list):
            raise TypeError(f"tags is a {type(tags).__name__}, not a list")
        return CacheEntry(
            text=str(fields["text"]),
            created_s=created_s,
            ttl_s=ttl_s,
            finish_reason=str(fields["finish_reason"]),
            generated_tokens=_tokens(fields["generated_tokens"]),
            tags=tuple(str(t) for t in tags),
            tenant_scope=str(fields.get("scope", "")),
            adapter=str(fields.get("adapter", "")),
            prompt_tokens=_tokens(fields.get("prompt_tokens", 0)),
            mean_logprob=_optional_float(fields.get("mean_logprob")),
            generation_s=_nonnegative(fields.get("generation_s", 0.0), MAX_GENERATION_S),
            temperature=_nonnegative(fields.get("temperature", 0.0), MAX_STORED_TEMPERATURE),
            endorsements=_count(fields.get("endorsements", 0)),
        )
    except (
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        OverflowError,
        RecursionError,
    ) as exc:
        raise CorruptEntry(f"payload does not decode: {exc}") from exc


def _tokens(value: object) -> int:
    """A stored token count, 0..2**31-1 (an int32 tensor carries it to llm, whose seal covers
    the stored value: one past that range would fail every hit); ValueError otherwise."""
    count = int(value)  # type: ignore[call-overload]
    if not 0 <= count <= MAX_TOKEN_COUNT:
        raise ValueError(f"token count {count} is out of range")
    return count


MAX_TOKEN_COUNT = 2**31 - 1


def _count(value: object) -> int:
    """A stored count, 0..MAX_ENDORSEMENTS (ValueError or TypeError otherwise: corrupt)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    if not 0 <= value <= MAX_ENDORSEMENTS:
        raise ValueError(f"{value!r} is not a count in 0..{MAX_ENDORSEMENTS}")
    return value


def _nonnegative(value: object, high: float) -> float:
    """A stored number in 0..`high` (ValueError or TypeError otherwise: a corrupt entry; an
    entry may come from Redis, where anyone who can write it can write anything)."""
    number = _optional_float(value)
    if number is None or not 0.0 <= number <= high:
        raise ValueError(f"{value!r} is not a number in 0..{high}")
    return number


def _optional_float(value: object) -> float | None:
    """A stored number (TypeError for anything else, a corrupt entry), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{value!r} is not a number")
    return float(value)


def peek_created_s(data: bytes | memoryview) -> float:
    """Creation time from the header alone (for eviction scans: a value read in place, not
    copied); raises `CorruptEntry`."""
    if len(data) < _HEADER.size or bytes(data[:4]) not in (MAGIC, _MAGIC_V1):
        raise CorruptEntry("bad header")
    return float(_HEADER.unpack_from(data)[1])
