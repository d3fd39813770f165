"""Exact-cache stores (tiercache.exact.stores, tiercache.exact.redis_tier) and their codec
(tiercache.exact.codec).

One contract suite runs against every store (L1 memory, L2 LMDB, L3 on a real redis-server);
store-specific behaviour follows it (Redis-specific tests: tests/integration/test_redis_tier.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import pytest

from tiercache.eviction import named_policy
from tiercache.exact.codec import (
    ENTRY_OVERHEAD_BYTES,
    MAGIC,
    CacheEntry,
    CorruptEntry,
    decode_entry,
    encode_entry,
    peek_created_s,
)
from tiercache.exact.keys import REDIS_VALUES
from tiercache.exact.l2_values import MIN_MAP_BYTES, L2Values
from tiercache.exact.redis_tier import RedisLink, RedisStore, Signer
from tiercache.exact.stores import GREEDY, SAMPLED, LmdbStore, MemoryStore, Store, answer_group
from tiercache.machine import DiskReading, DiskRoom


def entry(text: str = "answer", created_s: float = 1.0, **kwargs: object) -> CacheEntry:
    return CacheEntry(text=text, created_s=created_s, **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- contract (every store)


@pytest.fixture(params=["memory", "lmdb", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    s: Store
    if request.param == "memory":
        s = MemoryStore(1 << 20)
    elif request.param == "lmdb":
        s = LmdbStore(tmp_path / "l2", 1 << 20)
    else:
        server = request.getfixturevalue("redis_server")
        prefix = request.getfixturevalue("redis_prefix")
        # Redis expires entries itself, from the store's clock: pinned to the entries' epoch.
        link = RedisLink.from_url(server.url, prefix)
        s = RedisStore(link, 1 << 20, clock=lambda: 1.0, stats_max_age_s=0)
    yield s
    s.close()


def test_missing_key_is_none(store: Store) -> None:
    assert store.get("nope") is None


def test_put_get_round_trip(store: Store) -> None:
    e = entry("héllo ☃", created_s=12.5, ttl_s=3.0, finish_reason="length", generated_tokens=7)
    store.put("k", e)
    assert store.get("k") == e


def test_a_drop_deletes_only_what_was_read(store: Store) -> None:
    """`delete_if_same`: a reader drops the entry it found unusable, never one another process
    wrote in between (the write that replaced it stays)."""
    old, new = entry("expired", ttl_s=1.0), entry("fresh")
    store.put("k", old)
    assert store.get("k") == old
    store.put("k", new)  # another process, between the read and the drop
    assert store.delete_if_same("k", old) is False
    assert store.get("k") == new
    assert store.delete_if_same("k", None) is False  # it decodes: nothing corrupt to drop
    assert store.delete_if_same("k", new) is True
    assert store.get("k") is None and store.delete_if_same("k", new) is False


def test_redis_a_drop_leaves_a_value_written_after_its_read(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis: the drop reads the value, compares it here, then deletes by a script only while
    Redis still holds the very bytes read; a value written between the read and the script
    stays. And a corrupt value (sealed, not an entry) is dropped by a request's read."""
    server = request.getfixturevalue("redis_server")
    prefix = request.getfixturevalue("redis_prefix")
    secret = b"k" * 32
    store = RedisStore(RedisLink.from_url(server.url, prefix, secret=secret), 1 << 20,
                       clock=lambda: 1.0, stats_max_age_s=0)  # fmt: skip
    old, new = entry("expired", ttl_s=1.0), entry("fresh")
    store.put("k", old)
    unseal = store._unseal

    def written_meanwhile(name: str, stored: bytes, count: bool = True) -> bytes | None:
        store.put("k", new)  # another replica, after the read and before the script
        return unseal(name, stored, count)

    monkeypatch.setattr(store, "_unseal", written_meanwhile)
    assert store.delete_if_same("k", old) is False
    monkeypatch.undo()
    assert store.get("k") == new
    name = f"{prefix}e:bad"
    sealed = Signer(secret, REDIS_VALUES).seal(name, b"TCE1 not really an entry")
    store.link.client.set(name, sealed)
    assert store.get("bad") is None and store.link.client.exists(name) == 0
    store.close()


def test_overwrite(store: Store) -> None:
    store.put("k", entry("first"))
    store.put("k", entry("second"))
    assert store.get("k") == entry("second")
    assert store.stats().entries == 1


def test_delete(store: Store) -> None:
    store.put("k", entry())
    assert store.delete("k") is True
    assert store.delete("k") is False
    assert store.get("k") is None


def test_clear(store: Store) -> None:
    for i in range(5):
        store.put(f"k{i}", entry())
    store.clear()
    assert store.stats().entries == 0
    assert all(store.get(f"k{i}") is None for i in range(5))
    store.put("k0", entry("again"))
    assert store.get("k0") == entry("again")


def test_scan_and_delete_many(store: Store) -> None:
    for i in range(7):
        store.put(f"k{i}", entry(f"v{i}", tags=("a",) if i % 2 else ()))
    assert dict(store.scan()) == {
        f"k{i}": entry(f"v{i}", tags=("a",) if i % 2 else ()) for i in range(7)
    }
    assert store.delete_many(["k1", "k3", "nope"]) == 2
    assert sorted(k for k, _ in store.scan()) == ["k0", "k2", "k4", "k5", "k6"]


def test_an_entry_written_before_prompt_tokens_existed_reads_as_unknown() -> None:
    payload = json.dumps({"text": "x", "finish_reason": "stop", "generated_tokens": 3}).encode()
    old = decode_entry(_with_payload(payload))
    assert (old.prompt_tokens, old.generated_tokens) == (0, 3)
    assert b"prompt_tokens" not in encode_entry(entry("x"))  # written only when known


def test_an_entry_written_before_its_cost_was_recorded_reads_as_unknown_and_greedy() -> None:
    payload = json.dumps({"text": "x", "finish_reason": "stop", "generated_tokens": 3}).encode()
    old = decode_entry(_with_payload(payload))
    assert (old.generation_s, old.temperature) == (0.0, 0.0)
    assert answer_group(old) == GREEDY
    assert b"generation_s" not in encode_entry(entry("x"))  # written only when known
    assert answer_group(entry("x", temperature=0.7)) == SAMPLED


@pytest.mark.parametrize("field", ["generation_s", "temperature"])
@pytest.mark.parametrize("value", [-1.0, "2", None, True, 1e308, float("inf")])
def test_a_stored_cost_or_temperature_that_is_not_a_number_at_least_0_is_corrupt(
    field: str, value: object
) -> None:
    fields = {"text": "x", "finish_reason": "stop", "generated_tokens": 3, field: value}
    with pytest.raises(CorruptEntry):
        decode_entry(_with_payload(json.dumps(fields).encode()))


@pytest.mark.parametrize(
    "payload",
    [
        b"[]",  # checksummed, yet not an object
        json.dumps({"text": "x", "finish_reason": "stop", "generated_tokens": 1e999}).encode(),
        json.dumps({"text": "x", "finish_reason": "stop", "generated_tokens": 2**31}).encode(),
        json.dumps({"text": "x", "finish_reason": "stop", "generated_tokens": -1}).encode(),
        json.dumps(
            {"text": "x", "finish_reason": "stop", "generated_tokens": 1, "prompt_tokens": 2**40}
        ).encode(),
    ],
)
def test_a_payload_that_is_not_an_entry_is_corrupt_not_an_error(payload: bytes) -> None:
    """Each raised AttributeError or OverflowError, which the stores did not take for a
    corrupt entry (never dropped, a traceback on every read), or a token count an int32
    cannot carry (every hit on it refused by llm's seal check)."""
    with pytest.raises(CorruptEntry):
        decode_entry(_with_payload(payload))


def test_l1_keeps_the_answer_that_took_longer_to_generate() -> None:
    """L1's default policy weighs generation seconds: of two answers of one size, asked for as
    often, the one that took 20 s outlives the one that took 0.3 s, whichever came first."""
    for slow_first in (True, False):
        gdsf = named_policy("gdsf")
        store = MemoryStore(2 * (entry("x").size_bytes + gdsf.entry_overhead_bytes), gdsf)  # type: ignore[attr-defined]
        order = [("slow", 20.0), ("fast", 0.3)]
        for key, seconds in order if slow_first else order[::-1]:
            store.put(key, entry("x", generation_s=seconds))
        store.put("new", entry("x", generation_s=20.0))
        assert store.get("fast") is None
        assert store.get("slow") is not None


def test_entry_metadata_round_trip(store: Store) -> None:
    e = entry("x", tags=("kb:v7", "b"), tenant_scope="s" * 64, adapter="a" * 64)
    store.put("k", e)
    assert store.get("k") == e


def test_stats_count_hits_misses_entries(store: Store) -> None:
    store.get("a")
    store.put("a", entry())
    store.put("b", entry())
    store.get("a")
    store.get("a")
    store.get("c")
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.entries) == (2, 2, 2)
    assert stats.corrupt == 0
    assert 0 < stats.bytes <= stats.max_bytes == 1 << 20


# ---------------------------------------------------------------- MemoryStore


def test_memory_rejects_non_positive_budget() -> None:
    with pytest.raises(ValueError):
        MemoryStore(0)


def test_memory_byte_budget_holds() -> None:
    store = MemoryStore(10_000)
    sizes: dict[str, int] = {}
    for i in range(200):
        e = entry("é" * (i % 37) * 10)
        store.put(f"k{i}", e)
        sizes[f"k{i}"] = e.size_bytes
        assert store.stats().bytes <= 10_000
    stats = store.stats()
    assert sum(sizes[k] for k in sizes if store.get(k) is not None) == stats.bytes
    assert stats.bytes <= stats.max_bytes == 10_000
    assert stats.evictions == 200 - stats.entries > 0


def test_memory_size_counts_utf8_bytes() -> None:
    store = MemoryStore(10_000)
    store.put("k", entry("é" * 100))
    assert store.stats().bytes == 200 + ENTRY_OVERHEAD_BYTES


def test_memory_evicts_least_recently_used() -> None:
    store = MemoryStore(3 * entry("x").size_bytes)
    for key in "abc":
        store.put(key, entry("x"))
    assert store.get("a") is not None  # a is now the most recently used
    store.put("d", entry("x"))
    assert store.get("b") is None
    assert all(store.get(k) is not None for k in "acd")
    assert store.stats().evictions == 1


def test_memory_replacing_a_value_keeps_it_and_evicts_the_least_recently_used_others() -> None:
    small = entry("x").size_bytes
    store = MemoryStore(3 * small)
    for key in "abc":
        store.put(key, entry("x"))
    bigger = entry("x" * (small // 2))  # "a", the least recently used, now needs more room
    store.put("a", bigger)
    assert store.get("a") == bigger and store.get("b") is None and store.get("c") is not None
    assert store.stats().bytes == bigger.size_bytes + small


def test_memory_skips_entry_larger_than_budget() -> None:
    store = MemoryStore(1_000)
    store.put("small", entry("x"))
    store.put("big", entry("x" * 1_000))
    assert store.get("big") is None
    assert store.get("small") is not None
    assert store.stats().evictions == 0


# ---------------------------------------------------------------- LmdbStore


def _raw_put(path: Path, key: str, value: bytes) -> None:
    env = lmdb.open(str(path), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(key.encode(), value)
    env.close()


def test_lmdb_persists_across_reopen(tmp_path: Path) -> None:
    store = LmdbStore(tmp_path / "l2", 1 << 20)
    store.put("k", entry("kept", created_s=5.0))
    store.close()
    reopened = LmdbStore(tmp_path / "l2", 1 << 20)
    assert reopened.get("k") == entry("kept", created_s=5.0)
    reopened.close()


def _flipped_payload() -> bytes:
    data = bytearray(encode_entry(entry("payload")))
    data[-3] ^= 0x01
    return bytes(data)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"garbage bytes, not an entry", id="garbage"),
        pytest.param(b"", id="empty"),
        pytest.param(_flipped_payload(), id="flipped-payload-byte"),
        pytest.param(encode_entry(entry("payload"))[:-1], id="truncated"),
        pytest.param(b"XXXX" + encode_entry(entry("payload"))[4:], id="bad-magic"),
    ],
)
def test_lmdb_corrupt_value_is_a_counted_miss_and_dropped(tmp_path: Path, raw: bytes) -> None:
    path = tmp_path / "l2"
    LmdbStore(path, 1 << 20).close()
    _raw_put(path, "bad", raw)
    _raw_put(path, "good", encode_entry(entry("fine")))
    store = LmdbStore(path, 1 << 20)
    assert store.get("bad") is None
    stats = store.stats()
    assert (stats.corrupt, stats.misses, stats.entries) == (1, 1, 1)
    assert store.delete("bad") is False
    assert store.get("good") == entry("fine")
    store.close()


def test_lmdb_a_corrupt_value_rewritten_before_its_drop_stays(tmp_path: Path) -> None:
    """A read found the value corrupt; another process wrote a good one before the drop: the
    drop (`delete_if_same(key, None)`) leaves it, and deletes a value still corrupt."""
    path = tmp_path / "l2"
    LmdbStore(path, 1 << 20).close()
    _raw_put(path, "bad", b"XXXX" + encode_entry(entry("payload"))[4:])
    _raw_put(path, "rewritten", encode_entry(entry("fine")))
    store = LmdbStore(path, 1 << 20)
    assert store.delete_if_same("rewritten", None) is False
    assert store.get("rewritten") == entry("fine")
    assert store.delete_if_same("bad", None) is True
    store.close()


@pytest.mark.parametrize("text_bytes", [100, 1_000, 3_000])
def test_lmdb_tiny_map_evicts_oldest_first_and_never_raises(
    tmp_path: Path, text_bytes: int
) -> None:
    store = LmdbStore(tmp_path / "l2", 256 * 1024)
    keys = [f"k{i:05d}" for i in range(1_200)]
    for i, key in enumerate(keys):
        store.put(key, entry("x" * text_bytes, created_s=float(i)))
        assert store.get(key) is not None
    stats = store.stats()
    assert stats.evictions > 0
    assert 0 < stats.entries < len(keys)
    present = [k for k in keys if store.get(k) is not None]
    # Oldest first: what survives is exactly the newest entries.
    assert present == keys[len(keys) - len(present) :]
    store.close()


@pytest.mark.parametrize("text_bytes", [100, 3_000])
def test_lmdb_short_of_disk_turns_over_inside_its_file_and_critical_inside_half_of_it(
    tmp_path: Path, text_bytes: int
) -> None:
    """disk_headroom_bytes, with L2's own key shape (SHA-256 hex: writes and evictions spread
    over every leaf): once short, the file grows once, by what its first eviction copies, and
    then holds however much is written (twice ten times what it held); critically short, L2
    still takes every answer (on a host without Redis it is how llm's answers reach the
    lookups) but keeps its live pages under half the size the file had when the shortage
    began, and the file still holds; with room again, L2 grows."""

    def key(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    free = [1 << 40]
    disk = DiskRoom(
        tmp_path, 1 << 30, interval_s=0.0, read=lambda p: DiskReading(str(p), 1 << 41, free[0])
    )
    store = LmdbStore(tmp_path / "l2", 8 << 20, disk=disk)
    data = tmp_path / "l2" / "data.mdb"
    count = 100_000 // text_bytes
    for i in range(count):
        store.put(key(f"a{i}"), entry("x" * text_bytes, created_s=float(i)))
    grown = data.stat().st_size
    assert store.stats().evictions == 0
    free[0] = (1 << 30) - 1  # short
    sizes = []
    for round_ in range(2):
        keys = [key(f"b{round_}-{i}") for i in range(10 * count)]
        for i, k in enumerate(keys):
            store.put(k, entry("x" * text_bytes, created_s=float(10**6 + round_ * 10**5 + i)))
        assert store.get(keys[-1]) is not None
        sizes.append(data.stat().st_size)
    assert sizes[0] <= 2 * grown  # the first eviction's copies: at most the tree, once
    assert sizes[1] == sizes[0]  # then it holds
    assert store.stats().evictions > count and store.get(key("a0")) is None  # turned over
    short_bytes = store.stats().bytes
    assert short_bytes > grown // 2 + 4 * 4096
    free[0] = (1 << 29) - 1  # critical
    keys = [key(f"c{i}") for i in range(10 * count)]
    for i, k in enumerate(keys):
        store.put(k, entry("z" * text_bytes, created_s=float(2 * 10**6 + i)))
        assert store.get(k) is not None  # every answer taken
    assert store.stats().rejected == 0
    assert store.stats().bytes <= grown // 2 + 4 * 4096  # inside half the pinned file
    assert data.stat().st_size == sizes[1]  # and the file holds
    free[0] = 1 << 40  # room again
    for i in range(2 * count):
        store.put(key(f"d{i}"), entry("y" * text_bytes, created_s=float(10**7 + i)))
    assert data.stat().st_size > sizes[1]
    store.close()


def test_lmdb_write_that_meets_a_full_disk_evicts_and_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The disk short and full, and a write fails for want of disk (pages freed inside the file
    that an older reader still sees): L2 evicts a tenth and writes again; if that fails too,
    the answer is not stored (counted as rejected, logged once a minute, not valued), an older
    copy of the key is deleted (a newer one is kept), the request is not failed, and for a
    while no write evicts again for want of disk. With room, a full disk is an error."""
    free = [1 << 40]
    disk = DiskRoom(
        tmp_path, 1 << 30, interval_s=0.0, read=lambda p: DiskReading(str(p), 1 << 41, free[0])
    )
    values = L2Values(tmp_path / "l2-values", MIN_MAP_BYTES)
    store = LmdbStore(tmp_path / "l2", 8 << 20, disk=disk, values=values)
    for i in range(20):
        store.put(f"k{i:02d}", entry(f"answer {i}", created_s=float(i)))
    free[0] = (1 << 30) - 1  # short of the 1 GiB headroom
    store.put("k20", entry("answer 20", created_s=20.0))
    before = store.stats().evictions
    real_write = store._write
    failures = [1]

    def write(key: bytes, data: bytes) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        real_write(key, data)

    monkeypatch.setattr(store, "_write", write)
    store.put("new", entry("taken on the second try", created_s=50.0))
    assert store.get("new") == entry("taken on the second try", created_s=50.0)
    evicted = store.stats().evictions
    assert 1 <= evicted - before <= 3 and store.stats().rejected == 0  # a tenth, not half
    failures[0] = 2
    with caplog.at_level(logging.WARNING):
        store.put("k19", entry("a newer answer", created_s=100.0))
        assert store.get("k19") is None  # the older copy: deleted, not served in its place
        assert values.value("k19") is None  # and not valued as stored
        failures[0] = 1
        store.put("k18", entry("an older answer", created_s=5.0))  # paused: no eviction now
    assert store.peek("k18") == entry("answer 18", created_s=18.0)  # the newer copy: kept
    assert store.stats().rejected == 2 and store.stats().evictions == evicted + 2
    assert caplog.text.count("even after evicting") == 1
    free[0] = 1 << 40  # room: the error is the caller's, as it always was
    failures[0] = 1
    with pytest.raises(lmdb.DiskError):
        store.put("later", entry("x"))
    store.close()
    values.close()


def test_lmdb_garbage_database_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "l2"
    store = LmdbStore(path, 1 << 20)
    store.put("k", entry())
    store.close()
    (path / "data.mdb").write_bytes(b"this is not an lmdb file" * 1_000)
    reopened = LmdbStore(path, 1 << 20, clock=lambda: 1234.0)
    assert reopened.stats().entries == 0
    assert reopened.get("k") is None
    reopened.put("k2", entry("new"))
    assert reopened.get("k2") == entry("new")
    reopened.close()
    (aside,) = tmp_path.glob("l2.corrupt-1234-*")
    assert (aside / "data.mdb").read_bytes().startswith(b"this is not an lmdb file")


# ---------------------------------------------------------------- codec

_HEADER = struct.Struct("<4sddI32s")


def _with_payload(payload: bytes, created_s: float = 1.0, ttl_s: float = 0.0) -> bytes:
    """A well-formed TCE2 entry around `payload` (its checksum right: only the payload is off)."""
    times = struct.pack("<ddI", created_s, ttl_s, len(payload))
    checksum = hashlib.sha256(times + payload).digest()
    return _HEADER.pack(MAGIC, created_s, ttl_s, len(payload), checksum) + payload


def _v1(payload: bytes, created_s: float = 1.0, ttl_s: float = 0.0) -> bytes:
    """An entry as releases before 2026-12-06 wrote it: TCE1, the payload alone hashed."""
    checksum = hashlib.sha256(payload).digest()
    return _HEADER.pack(b"TCE1", created_s, ttl_s, len(payload), checksum) + payload


def test_a_flipped_bit_in_the_header_times_is_corrupt() -> None:
    """TCE2's checksum covers created_s and ttl_s: a flipped exponent bit that would move an
    entry's creation past every invalidation (and its age below every max-age) is caught."""
    data = bytearray(encode_entry(entry("answer", created_s=1_700_000_000.0)))
    data[4 + 7] ^= 0x01  # created_s's top byte: about 6.8e9 s after 1970
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(bytes(data))
    data = bytearray(encode_entry(entry("answer", created_s=1_700_000_000.0)))
    data[12 + 2] ^= 0x10  # ttl_s
    with pytest.raises(CorruptEntry, match="checksum"):
        decode_entry(bytes(data))


def test_entries_written_before_the_header_was_hashed_still_decode_if_they_make_sense() -> None:
    payload = json.dumps({"text": "old", "finish_reason": "stop", "generated_tokens": 2}).encode()
    old = decode_entry(_v1(payload, created_s=1_700_000_000.0, ttl_s=60.0))
    assert (old.text, old.created_s, old.ttl_s) == ("old", 1_700_000_000.0, 60.0)
    assert peek_created_s(_v1(payload)) == 1.0
    for created_s, ttl_s in ((6.8e9, 0.0), (math.inf, 0.0), (math.nan, 0.0), (1.0, -5.0)):
        with pytest.raises(CorruptEntry, match="make no sense"):
            decode_entry(_v1(payload, created_s, ttl_s))


@pytest.mark.parametrize(
    "e",
    [
        entry(),
        entry("", created_s=0.0),
        entry(
            'héllo ☃ "q" \n',
            created_s=1e9 + 0.25,
            ttl_s=60.0,
            finish_reason="length",
            generated_tokens=12,
        ),
        entry("with usage", generated_tokens=12, prompt_tokens=31),
        entry("sampled", generation_s=2.5, temperature=0.7, mean_logprob=-0.25),
    ],
)
def test_codec_round_trip(e: CacheEntry) -> None:
    data = encode_entry(e)
    assert decode_entry(data) == e
    assert decode_entry(memoryview(data)) == e
    assert peek_created_s(data) == e.created_s


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "truncated-header": lambda d: d[: _HEADER.size - 1],
    "empty": lambda d: b"",
    "bad-magic": lambda d: b"TCE0" + d[4:],
    "payload-longer": lambda d: d + b"x",
    "payload-shorter": lambda d: d[:-1],
    "checksum": lambda d: d[:-1] + bytes([d[-1] ^ 0x20]),
    "not-json": lambda d: _with_payload(b"not json"),
    "missing-field": lambda d: _with_payload(json.dumps({"text": "x"}).encode()),
    "not-utf8": lambda d: _with_payload(b"\xff\xfe"),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_codec_rejects_corruption(corrupt: Callable[[bytes], bytes]) -> None:
    with pytest.raises(CorruptEntry):
        decode_entry(corrupt(encode_entry(entry("some answer"))))


def test_peek_rejects_bad_header() -> None:
    with pytest.raises(CorruptEntry):
        peek_created_s(b"TCE0" + encode_entry(entry())[4:])
    with pytest.raises(CorruptEntry):
        peek_created_s(b"TCE1")


@pytest.mark.parametrize(
    ("ttl_s", "now_s", "expired"),
    [(0.0, 1e12, False), (10.0, 10.999, False), (10.0, 11.0, True), (10.0, 50.0, True)],
)
def test_entry_expiry(ttl_s: float, now_s: float, expired: bool) -> None:
    assert entry(created_s=1.0, ttl_s=ttl_s).expired(now_s) is expired


def _grow_l2(path: str, max_bytes: int, count: int) -> None:
    """In another process: a stage with a larger l2_max_bytes fills the shared L2."""
    big = LmdbStore(Path(path), max_bytes)
    for i in range(count):
        big.put(f"k{i}", entry("x" * 2000))
    big.close()


def test_l2_grown_by_a_stage_with_a_larger_map_is_a_miss_not_an_error(tmp_path: Path) -> None:
    """Before, every read and write of the smaller stage raised MapResizedError (each request
    an error) until a restart."""
    import multiprocessing

    small = LmdbStore(tmp_path / "l2", 1 << 20)
    small.put("mine", entry("kept"))
    process = multiprocessing.get_context("spawn").Process(
        target=_grow_l2, args=(str(tmp_path / "l2"), 16 << 20, 3000)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    assert small.get("mine") is None  # a miss, with a warning naming the fix
    with pytest.raises(OSError, match="same l2_max_bytes on every stage"):
        small.put("new", entry("y"))
    small.close()
    assert LmdbStore(tmp_path / "l2", 16 << 20).get("mine") == entry("kept")


def test_l1_reports_the_value_its_evictions_gave_up_and_how_skewed_its_hits_are() -> None:
    """Issue 19's metrics for L1: hits the evicted entries had had, entries refused (larger than
    the budget), entries deleted other than by eviction, and the share of hits the hottest 1 %
    of the held entries take."""
    size = entry("x" * 10).size_bytes
    store = MemoryStore(200 * size)  # LRU: the least recently used is evicted first
    for i in range(200):
        store.put(f"k{i:03d}", entry("x" * 10))
    for _ in range(97):
        store.get("k150")
    store.get("k151")
    store.get("k152")
    first = store.stats()
    assert first.hit_skew == pytest.approx(98 / 99)  # the hottest 2 of 200 took 98 of 99 hits
    assert (first.evictions, first.evicted_hits, first.rejected, first.removed) == (0, 0, 0, 0)
    store.get("k000")
    store.get("k000")
    store.get("k001")  # now k000 and k001 are the most recent: k002, k003, k004 go first
    for i in range(3):
        store.put(f"new{i}", entry("x" * 10))
    store.put("k000", entry("x" * 10))  # rewritten: its hits stay with it
    assert [store.get(f"k00{i}") is None for i in range(5)] == [False, False, True, True, True]
    for key in ("k150", "k006"):
        assert store.delete(key)
    store.put("huge", entry("x" * (300 * size)))
    stats = store.stats()
    assert (stats.evictions, stats.evicted_hits) == (3, 0)  # k002, k003, k004 had no hits
    assert (stats.rejected, stats.removed) == (1, 2)
    # a policy that evicts hit entries: their hits count as given up
    small = MemoryStore(2 * size)
    small.put("a", entry("x" * 10))
    small.put("b", entry("x" * 10))
    small.get("a")
    small.get("b")
    small.get("b")
    small.put("c", entry("x" * 10))  # evicts a (1 hit)
    small.put("d", entry("x" * 10))  # evicts b (2 hits)
    assert small.stats().evicted_hits == 3


def test_l2_full_of_digest_keyed_answers_evicts_instead_of_failing(tmp_path: Path) -> None:
    """Digests spread over every leaf page: deleting a tenth of them in one transaction would
    copy nearly all pages, more than the free quarter of the map (MDB_MAP_FULL on every write
    once L2 was full). Evictions delete in small chunks instead."""
    store = LmdbStore(tmp_path / "l2", 4 << 20)
    for i in range(6_000):
        store.put(hashlib.sha256(str(i).encode()).hexdigest(), entry("x" * 400, float(i)))
    stats = store.stats()
    assert stats.evictions > 0 and 0 < stats.entries < 6_000
    newest = hashlib.sha256(b"5999").hexdigest()
    assert store.get(newest) is not None
    store.close()


def test_l2_evicting_early_runs_on_its_own_thread_and_the_writes_never_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evict_early (what the stages open): the write that enters the early band wakes the
    store's evictor thread and goes on; every eviction runs there while the writes are slower
    than it, none in a write; what survives is the newest (oldest first, as inline); closing
    joins the thread. Without it, the write that reaches the mark evicts itself."""
    import threading
    import time

    ran_in: list[str] = []
    evict = LmdbStore._evict

    def recorded(self: LmdbStore, fraction: float | None = None) -> None:
        ran_in.append(threading.current_thread().name)
        evict(self, fraction)

    monkeypatch.setattr(LmdbStore, "_evict", recorded)
    early = LmdbStore(tmp_path / "early", 4 << 20, evict_early=True)
    keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(6_000)]
    for i, key in enumerate(keys):
        early.put(key, entry("x" * 400, float(i)))
        if early.stats().bytes > (4 << 20) * 0.75 * 0.96:  # in the band: let it catch up
            deadline = time.monotonic() + 10.0
            while early.stats().bytes > (4 << 20) * 0.75 * 0.96 and time.monotonic() < deadline:
                time.sleep(0.005)
    stats = early.stats()
    assert stats.evictions > 0 and 0 < stats.entries < len(keys)
    present = [k for k in keys if early.get(k) is not None]
    assert present == keys[len(keys) - len(present) :]  # oldest first
    evictor = early._evictor
    early.close()  # joins an eviction still under way
    assert evictor is not None and not evictor.is_alive()
    assert ran_in and set(ran_in) == {"l2-evict"}  # never in a write
    assert early.early_evictions == len(ran_in)

    ran_in.clear()
    inline = LmdbStore(tmp_path / "inline", 4 << 20)
    for i, key in enumerate(keys):
        inline.put(key, entry("x" * 400, float(i)))
    assert ran_in and set(ran_in) == {threading.current_thread().name}
    assert inline.early_evictions == 0 and inline._evictor is None
    inline.close()


def test_l2_eviction_keeps_a_victim_written_again_since_its_scan(tmp_path: Path) -> None:
    """An eviction deletes by name what its scan chose; a key written again meanwhile (a fresh
    answer: the writes go on while L2 evicts on its own thread) stays."""
    store = LmdbStore(tmp_path / "l2", 1 << 20)
    store.put("fresh", entry("new answer", created_s=5.0))
    store.put("stale", entry("old answer", created_s=2.0))
    scanned = {b"fresh": 1.0, b"stale": 2.0}  # what the scan saw: fresh was older then
    assert store._delete_chunked([b"fresh", b"stale"], scanned) == [b"stale"]
    assert store.get("fresh") == entry("new answer", created_s=5.0)
    assert store.get("stale") is None
    store.close()


def test_l2_evicting_early_pauses_after_an_eviction_that_freed_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write in the early band wakes the evictor; when its eviction frees nothing, it
    does not scan again at each of them (a pause of DISK_RETRY_PAUSE_S)."""
    import time

    store = LmdbStore(tmp_path / "l2", 4 << 20, evict_early=True)
    limit = (4 << 20) * 0.75
    i = 0
    while store.stats().bytes < limit * 0.9:
        i += 1
        store.put(f"k{i:06d}", entry("x" * 400, float(i)))
    calls: list[float] = []
    monkeypatch.setattr(LmdbStore, "_evict", lambda self, fraction=None: calls.append(0.0))
    while store.stats().bytes < limit * 0.97:  # into the band, under the mark
        i += 1
        store.put(f"k{i:06d}", entry("x" * 400, float(i)))
        time.sleep(0.002)  # the evictor wakes between writes
    deadline = time.monotonic() + 5.0
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(50):  # more writes in the band within the pause
        i += 1
        store.put(f"k{i:06d}", entry("x" * 40, float(i)))
        time.sleep(0.002)
    store.close()
    assert len(calls) == 1


def test_the_held_answer_put_again_with_a_new_verdict_counts_that_verdict_alone() -> None:
    """feedback's `good` re-puts the held entry with one more endorsement: L1 counts the new
    one as a request (as `endorse` does). Re-admitting it counted every endorsement again
    (three verdicts: a count of 10 where 4 is right) and made it look proven."""
    from tiercache.exact.codec import CacheEntry

    def endorsed_by_put(times: int) -> int:
        store = MemoryStore(1 << 20, named_policy("gdsf"))
        entry = CacheEntry("an answer", created_s=1.0, generation_s=0.5)
        store.put("k", entry)
        for n in range(1, times + 1):
            entry = CacheEntry("an answer", created_s=1.0, generation_s=0.5, endorsements=n)
            store.put("k", entry)
        held = store.peek("k")
        assert held is not None and held.endorsements == times
        return store._policy.ranked_frequency("k")  # type: ignore[attr-defined]  # noqa: SLF001

    def endorsed_by_endorse(times: int) -> int:
        store = MemoryStore(1 << 20, named_policy("gdsf"))
        store.put("k", CacheEntry("an answer", created_s=1.0, generation_s=0.5))
        for n in range(1, times + 1):
            store.endorse("k", 1.0, n)
        return store._policy.ranked_frequency("k")  # type: ignore[attr-defined]  # noqa: SLF001

    assert endorsed_by_put(3) == endorsed_by_endorse(3) == 4
    # Another answer under the key (a new generation) is admitted as before.
    store = MemoryStore(1 << 20, named_policy("gdsf"))
    store.put("k", CacheEntry("an answer", created_s=1.0))
    store.put("k", CacheEntry("a newer answer", created_s=2.0))
    held = store.peek("k")
    assert held is not None and held.text == "a newer answer"


def test_a_map_the_address_space_cannot_take_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """l2_max_bytes of 2^70 raised OverflowError, 2^48 lmdb.MemoryError: tracebacks at a
    stage's load that named no parameter."""
    from tiercache.errors import ConfigError
    from tiercache.exact.stores import open_lmdb

    for size in (1 << 70, 1 << 48):
        with pytest.raises(ConfigError, match="cannot be mapped"):
            open_lmdb(tmp_path / f"l2-{size.bit_length()}", size, "L2")


def test_l2s_change_token_moves_with_any_processs_write_and_not_with_reads(
    tmp_path: Path,
) -> None:
    """`LmdbStore.change_token` (what an L1 copy's owner checks before comparing it with L2):
    LMDB's last transaction id, moved by every write from any process of the host (here a
    real one: LMDB opens an environment once per process), whatever that process's settings;
    reads move nothing."""
    store = LmdbStore(tmp_path / "l2", 1 << 20)
    store.put("a", CacheEntry("one", 1.0))
    first = store.change_token()
    assert first is not None
    assert store.get("a") is not None and store.peek("a") is not None
    assert store.change_token() == first
    writer = (
        "import sys; from pathlib import Path\n"
        "from tiercache.exact.codec import CacheEntry\n"
        "from tiercache.exact.stores import LmdbStore\n"
        "s = LmdbStore(Path(sys.argv[1]), 1 << 20); s.put('b', CacheEntry('two', 2.0)); s.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run(
        [sys.executable, "-c", writer, str(tmp_path / "l2")], check=True, env=env, timeout=60
    )
    moved = store.change_token()
    assert moved is not None and moved != first
    assert store.delete("b")
    assert store.change_token() not in (None, moved)
    store.close()


def test_lmdb_merge_that_meets_a_full_disk_evicts_and_tries_again_and_never_deletes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge (a side record read and written in one transaction) meets the disk short and
    full as a `put` does: it evicts and writes again; failing again, it is counted as
    rejected and raised, and the key's copy is left as it was (a floor must not fall), and for
    a while no merge evicts again for want of disk. With room, the error is the caller's."""
    free = [1 << 40]
    disk = DiskRoom(
        tmp_path, 1 << 30, interval_s=0.0, read=lambda p: DiskReading(str(p), 1 << 41, free[0])
    )
    store = LmdbStore(tmp_path / "l2", 8 << 20, disk=disk)
    for i in range(20):
        store.put(f"k{i:02d}", entry(f"answer {i}", created_s=float(i)))
    store.put("floor", entry("0.5", created_s=30.0))
    free[0] = (1 << 30) - 1  # short of the 1 GiB headroom
    real = store._merged
    failures = [1]

    def merged(raw_key: bytes, make: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")
        return real(raw_key, make)

    def higher(held: CacheEntry | None) -> CacheEntry:
        return entry(f"{held.text if held else ''}+1", created_s=40.0)

    monkeypatch.setattr(store, "_merged", merged)
    before = store.stats().evictions
    assert store.merge("floor", higher)
    assert store.peek("floor") == entry("0.5+1", created_s=40.0)
    evicted = store.stats().evictions
    assert evicted > before and store.stats().rejected == 0
    failures[0] = 2
    with pytest.raises(lmdb.DiskError):
        store.merge("floor", higher)
    assert store.peek("floor") == entry("0.5+1", created_s=40.0)  # kept, not deleted
    assert store.stats().rejected == 1 and store.stats().evictions == evicted + 1
    failures[0] = 1
    with pytest.raises(lmdb.DiskError):  # paused: no eviction now, counted as rejected
        store.merge("floor", higher)
    assert store.stats().evictions == evicted + 1 and store.stats().rejected == 2
    free[0] = 1 << 40  # room: the error is the caller's
    failures[0] = 1
    with pytest.raises(lmdb.DiskError):
        store.merge("floor", higher)
    store.close()


def test_a_reader_killed_inside_a_read_does_not_stop_l2_taking_writes(tmp_path: Path) -> None:
    """A process killed holding a read transaction leaves its reader slot: LMDB then reuses no
    page freed since, and the map filled though the live entries fit. Each write met
    MapFullError, evicted half of L2 and failed again (5,891 of 6,000 in a review's run). The
    write now frees the dead readers' slots first and goes through."""
    store = LmdbStore(tmp_path / "l2", 4 << 20)
    for i in range(2_000):
        store.put(f"k{i}", CacheEntry("x" * 200, 1.0))
    script = (
        "import lmdb, os, signal, sys\n"
        "env = lmdb.open(sys.argv[1], subdir=True, readonly=True, lock=True, max_dbs=0)\n"
        "txn = env.begin()\n"
        "txn.get(b'k1')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path / "l2")], check=False)
    assert child.returncode == -9
    failed = 0
    for i in range(6_000):
        try:
            store.put(f"n{i}", CacheEntry("y" * 200, 2.0))
        except lmdb.Error:
            failed += 1
    assert failed == 0
    assert store.get("n5999") is not None
    store.close()


def test_a_damaged_page_met_by_the_eviction_scan_still_evicts_what_was_read(
    tmp_path: Path,
) -> None:
    """A damaged page met while the eviction scan walks L2: the error escaped into `put`, and
    every write at the high-water mark failed until a restart. What the scan read before it
    is ranked and evicted now, and the write goes through."""
    store = LmdbStore(tmp_path / "l2", 1 << 20)
    for i in range(300):
        store.put(f"k{i:03d}", CacheEntry("x" * 100, float(i)))
    real = store._env

    class DamagedScan:
        """The environment, with a read-only cursor that meets a damaged page halfway."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def begin(self, **kwargs: Any) -> Any:
            txn = real.begin(**kwargs)
            if kwargs.get("write"):
                return txn

            class Txn:
                def __enter__(self) -> Any:
                    txn.__enter__()
                    return self

                def __exit__(self, *exc: Any) -> Any:
                    return txn.__exit__(*exc)

                def cursor(self) -> Any:
                    for n, item in enumerate(txn.cursor()):
                        if n == 150:
                            raise lmdb.CorruptedError("mdb_cursor_next: MDB_CORRUPTED")
                        yield item

                def __getattr__(self, name: str) -> Any:
                    return getattr(txn, name)

            return Txn()

    store._env = DamagedScan()  # type: ignore[assignment]
    with store._evict_lock:
        store._evict(fraction=0.5)  # raised before
    store._env = real
    held = sum(store.get(f"k{i:03d}") is not None for i in range(300))
    assert 200 <= held < 300  # half of the 150 read went (the oldest)
    store.close()
