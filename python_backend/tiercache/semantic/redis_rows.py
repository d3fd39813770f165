"""Semantic rows shared through Redis, so a replica on another host (or a new one) finds the
answers the fleet has already given to reworded prompts.

The host's row log (`SemanticStore`, LMDB) and its shared tables stay the only local store;
Redis carries a copy of each row between hosts:

- **Write** (`RowPublisher`, in the llm stage, after it stored an answer and appended the index
  row locally): `XADD <prefix>semantic MAXLEN ~ max_rows` with the row (scope, answer digest,
  normalized prompt, vector as float32 bytes, embedder key) plus what the answer's cache entry
  says an invalidation matches on (generation start `created_s`, expiry, tags, tenant scope,
  adapter digest) and the writing host's log id.
- **Follow** (`RowFollower`, one thread in the llm process, the one that owns index writes on a
  host): `XREAD COUNT batch BLOCK short` from the last stream id this host has stored, and the
  rows it lacks go through the normal write path (`SemanticStore.log_rows`, then the scope's
  table), with the new last id written in the same LMDB transaction as the rows. A restart
  resumes there; a fresh host reads the stream from its start (the catch-up). A row that starts
  a scope counts toward its answer's tenant scope (the row's `tenant`): the host's per-tenant
  cap on scopes holds for shared rows too.

Why a stream: it is an ordered log with ids to resume from, bounded by an approximate MAXLEN
(the trim works on whole radix-tree nodes, so it is cheap), and a follower reads it in batches
with one blocking call; a hash or sorted set would need a separate change feed.

Idempotence: a row whose digest the scope already has keeps its row (the log's digest key), so a
row read back from Redis and the host's own row for the same answer are one row; rows this host
wrote are skipped by their origin (the log id) without touching LMDB.

Authentication: whoever can write Redis must not be able to plant rows (a prompt pointing at
another scope's answer, a vector that wins every search). Each stream entry carries `t`, an
HMAC-SHA256 under `derive_key(secret, "semantic rows")` (the link's `Signer`) over the stream's
key name and the entry's fields `m` and `v`; the follower skips an entry whose tag does not verify
and counts it (`forged`; also in the link's `forged`). Rows published before the tags (older
releases) are skipped the same way: their answers are still exact hits, and a replica indexes
the row again when it generates the answer again.

Invalidation: a semantic hit takes its text from the exact cache (`TieredCache.get`), which
checks every watermark, so a replayed row can never serve an invalidated answer. The follower
also drops such rows before they reach the log: it waits until the process's invalidation
listener has read the recorded watermarks, and skips a row the watermark table covers (or whose
answer has expired), judged on the entry metadata the row carries. A row replayed before its
answer was invalidated stays in the log; a lookup that picks it finds the answer refused by the
exact cache (`stale`), never served.

Redis down: every call goes through the process's `RedisLink` (breaker); a publish is skipped
(the row stays local), the follower waits `retry_s` and resumes from its stored id, so rows
written meanwhile arrive once Redis is back (those trimmed away meanwhile do not). Memory: one
batch of rows at a time in the follower; Redis holds about max_rows x (4 x dimensions + ~300)
bytes (1.9 KB per 384-float row).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import lmdb
import numpy as np

from tiercache.exact.codec import CacheEntry
from tiercache.exact.keys import REDIS_SEMANTIC_ROWS
from tiercache.exact.redis_tier import RedisLink, Signer
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import InvalidationTable
from tiercache.log_throttle import LogThrottle
from tiercache.semantic import compaction
from tiercache.semantic.row_log import MAX_DIGEST_BYTES, ScopeLimitReached
from tiercache.semantic.store import SemanticStore
from tiercache.threads import NamedThread

log = logging.getLogger(__name__)

STREAM = "semantic"  # <prefix>semantic
DEFAULT_MAX_ROWS = 1_000_000
_MISSING = object()
_LAST_ID_META = b"meta:redis-stream:"  # + the stream key: the last id this host has stored
_SIGNED_FIELDS = ("m", "v")  # a row's fields, in the order its tag `t` covers them
# A row is read at most this long (its vector and the prompt's text take tens of KiB at the
# prompt limit); a longer one comes as a marker the follower counts as forged. A batch stops
# adding rows past MAX_BATCH_BYTES (one row at least), so a stream flooded with large rows costs
# a reader a few MiB a batch, not the rows' size.
MAX_ROW_BYTES = 256 << 10
MAX_BATCH_BYTES = 8 << 20
# XRANGE after the last id read, each row's size checked inside Redis: a longer row's fields are
# replaced by {"oversized": <bytes>}; rows past the batch's byte budget are left for the next.
_BOUNDED_READ = """
local rows = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', tonumber(ARGV[2]))
local max_row, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local out, total = {}, 0
for _, row in ipairs(rows) do
  local size = 0
  for _, value in ipairs(row[2]) do size = size + string.len(value) end
  if size > max_row then
    row[2] = {'oversized', tostring(size)}
    size = 0
  end
  if #out > 0 and total + size > budget then return {out, 1} end
  total = total + size
  out[#out + 1] = row
end
return {out, 0}
"""


def sign_fields(signer: Signer, key: str, fields: dict[str, bytes]) -> dict[str, bytes]:
    """`fields` of a row for the stream `key`, with `t`: the tag over `key`, `m` and `v`."""
    return {**fields, "t": signer.tag(key, *(fields[name] for name in _SIGNED_FIELDS))}


def fields_verify(signer: Signer, key: str, fields: dict[bytes, bytes]) -> bool:
    """Whether a stream entry's `t` is the fleet's tag over its `m` and `v` under `key`; a
    refusal is counted by `signer`."""
    tag, parts = fields.get(b"t"), [fields.get(name.encode()) for name in _SIGNED_FIELDS]
    if tag is None or any(part is None for part in parts):
        signer.refuse(key)
        return False
    return signer.verify(tag, key, *(part for part in parts if part is not None))


@dataclass(frozen=True, slots=True)
class SharedRow:
    """One semantic row as it travels through Redis: the local row's fields plus the answer's
    invalidation metadata (what `InvalidationTable.covers` looks at) and the writing host."""

    scope: str
    digest: str
    prompt: str
    vector: np.ndarray  # float32
    embedder: str  # the embedder key (vectors of two embedders are not comparable)
    created_s: float  # when the answer's generation started (the entry's created_s)
    expires_s: float  # when the answer expires (0: never)
    tags: tuple[str, ...]
    tenant: str  # the entry's tenant scope
    adapter: str  # the entry's adapter digest
    origin: str  # the writing host's row log id (hex)

    @classmethod
    def of_entry(
        cls,
        scope: str,
        digest: str,
        prompt: str,
        vector: np.ndarray,
        embedder: str,
        entry: CacheEntry,
        origin: str,
    ) -> SharedRow:
        expires_s = entry.created_s + entry.ttl_s if entry.ttl_s > 0 else 0.0
        return cls(
            scope,
            digest,
            prompt,
            np.ascontiguousarray(vector, dtype=np.float32).reshape(-1),
            embedder,
            entry.created_s,
            expires_s,
            entry.tags,
            entry.tenant_scope,
            entry.adapter,
            origin,
        )

    def to_fields(self) -> dict[str, bytes]:
        meta = {
            "scope": self.scope,
            "digest": self.digest,
            "prompt": self.prompt,
            "embedder": self.embedder,
            "created_s": self.created_s,
            "expires_s": self.expires_s,
            "tags": list(self.tags),
            "tenant": self.tenant,
            "adapter": self.adapter,
            "origin": self.origin,
        }
        return {
            "m": json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
            "v": self.vector.tobytes(),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> SharedRow:
        """The row; ValueError when the entry is not one of ours (or damaged)."""
        try:
            meta = json.loads(fields[b"m"].decode("utf-8"))
            raw = fields[b"v"]
            if not raw or len(raw) % 4:
                raise ValueError(f"a vector of {len(raw)} bytes")
            vector = np.frombuffer(raw, dtype=np.float32).copy()
            if not np.all(np.isfinite(vector)):
                raise ValueError("a vector with NaN or infinite values")
            tags = meta["tags"]
            if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                raise ValueError("tags must be a list of strings")
            texts = [meta[k] for k in ("scope", "digest", "prompt", "embedder")]
            texts += [meta[k] for k in ("tenant", "adapter", "origin")]
            if not all(isinstance(t, str) for t in texts) or not meta["scope"]:
                raise ValueError("a field that must be text is not")
            if len(meta["digest"].encode("utf-8")) > MAX_DIGEST_BYTES:
                raise ValueError(f"an answer digest longer than {MAX_DIGEST_BYTES} bytes")
            return cls(
                meta["scope"],
                meta["digest"],
                meta["prompt"],
                vector,
                meta["embedder"],
                float(meta["created_s"]),
                float(meta["expires_s"]),
                tuple(tags),
                meta["tenant"],
                meta["adapter"],
                meta["origin"],
            )
        except (KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"malformed semantic row: {exc!r}") from exc

    def entry(self) -> CacheEntry:
        """A stand-in of the answer's entry with what invalidations match on (no text)."""
        ttl_s = self.expires_s - self.created_s if self.expires_s > 0 else 0.0
        return CacheEntry(
            text="",
            created_s=self.created_s,
            ttl_s=ttl_s,
            tags=self.tags,
            tenant_scope=self.tenant,
            adapter=self.adapter,
        )


class RowPublisher:
    """Appends rows to the deployment's stream (`<prefix>semantic`), trimmed to about
    `max_rows`, signed under the link's secret (`sign_fields`). Best effort: with Redis down the
    row stays on this host only."""

    def __init__(self, link: RedisLink, max_rows: int = DEFAULT_MAX_ROWS) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.link = link
        self.key = link.key(STREAM)
        self.max_rows = max_rows
        self._signer = link.signer(REDIS_SEMANTIC_ROWS)
        self._lock = threading.Lock()
        self.published = 0
        self.failed = 0

    def publish(self, row: SharedRow) -> bool:
        fields = sign_fields(self._signer, self.key, row.to_fields())
        added = self.link.call(
            lambda c: c.xadd(self.key, fields, maxlen=self.max_rows, approximate=True),  # type: ignore[arg-type]
            None,
        )
        with self._lock:
            if added is None:
                self.failed += 1
            else:
                self.published += 1
        return added is not None


@dataclass(frozen=True, slots=True)
class FollowerStats:
    following: bool  # this process holds the host's follower lock
    caught_up: bool  # it has read the stream to its end at least once
    read: int  # stream entries read
    added: int  # rows new to this host's log
    duplicate: int  # rows the host's log already had (same scope and digest)
    own: int  # rows this host wrote (skipped)
    dead: int  # rows whose answer was invalidated or has expired (skipped)
    foreign: int  # rows of another embedder or width (skipped)
    malformed: int  # entries that are not rows of ours (skipped)
    last_id: str  # the last stream id this host has stored
    forged: int = 0  # entries whose tag did not verify: not signed with the fleet's secret


class CompactionPending(Exception):
    """The log is past its mark and its last compaction failed moments ago: the batch waits."""


class DiskShort(Exception):
    """The state directory's disk is too short to log rows from other replicas now."""


class RowFollower:
    """A thread that keeps this host's semantic log in step with the deployment's stream.

    One per host: the thread takes an `flock` on `lock_path` (non-blocking; retried every
    `retry_s`, so another process takes over when the holder exits), and only the holder reads.
    `ready()` gates reading (the invalidation listener has read the recorded watermarks); the
    rows whose tag verifies (`fields_verify`; the others are `forged`, skipped) then pass
    `invalidations` and are appended with `SemanticStore.log_rows`, which drops
    duplicates by digest, and published to their scopes' tables. `close()` stops and joins it
    (at most one blocking read, `block_s`, plus one Redis timeout).
    """

    def __init__(
        self,
        link: RedisLink,
        store: SemanticStore,
        invalidations: InvalidationTable,
        *,
        lock_path: Path,
        ready: Callable[[], bool] = lambda: True,
        answer_exists: Callable[[str], bool] = lambda digest: True,
        answer_value: Callable[[str], float] | None = None,
        embedder: str = "",
        dimensions: int = 0,
        batch_rows: int = 512,
        block_s: float = 0.1,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`embedder`/`dimensions` ("" / 0: any) keep rows this host cannot search out of its
        log; `answer_exists` and `answer_value` are for compaction when the log is full (as in
        the llm stage: rows whose answers are gone, else those worth least, go)."""
        self.link = link
        self.store = store
        self.invalidations = invalidations
        self.key = link.key(STREAM)
        self._signer = link.signer(REDIS_SEMANTIC_ROWS)
        self._lock_path = lock_path
        self._ready = ready
        self._answer_exists = answer_exists
        self._answer_value = answer_value
        self._compact_failed_s = -math.inf  # when its last compaction failed (monotonic)
        self._apply_log = LogThrottle()
        self._embedder = embedder
        self._dimensions = dimensions
        self._batch_rows = batch_rows
        # The wait between reads that found nothing (the read itself never blocks in Redis; it
        # once did, and had to end well inside the socket timeout).
        self._block_ms = max(1, int(1000 * min(block_s, 0.5 * link.timeout_s)))
        self._block_s = self._block_ms / 1000  # the wait between reads that found nothing
        self._script: Any = None  # _BOUNDED_READ, registered on the first read
        self._cut = False  # the last read stopped at MAX_BATCH_BYTES
        self._retry_s = retry_s
        self._clock = clock
        self._origin = store.log_id.hex()
        self._meta_key = _LAST_ID_META + self.key.encode("utf-8")
        stored = store.meta(self._meta_key)
        self._last_id = stored.decode() if stored else "0-0"
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._lock_fd: int | None = None
        self._lock_refused = threading.Event()  # another process of the host is the follower
        self._thread: threading.Thread | None = None
        self._counts = dict.fromkeys(
            ("read", "added", "duplicate", "own", "dead", "foreign", "malformed", "forged"), 0
        )
        self._stats_lock = threading.Lock()

    @property
    def origin(self) -> str:
        """This host's id in the rows it publishes (its row log's id)."""
        return self._origin

    def start(self) -> RowFollower:
        self._thread = NamedThread(target=self._run, name="tiercache-semantic-follower")
        self._thread.daemon = True  # close() joins it; never keeps a stub process alive
        self._thread.start()
        return self

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait until the stream has been read to its end, at most `timeout_s`. Returns early
        (False) when Redis is unavailable or another process on the host is the follower."""
        deadline = time.monotonic() + timeout_s
        while not self._caught_up.wait(0.02):
            if time.monotonic() >= deadline or self.link.breaker.is_open:
                return False
            if self._lock_refused.is_set():
                return False
        return True

    def _run(self) -> None:
        try:
            self._follow()
        finally:  # whatever ends the thread: another process of the host may take over
            self._release_lock()

    def _follow(self) -> None:
        check_reset = True
        next_probe = 0.0
        disk_logged_s = -60.0
        while not self._stop.is_set():
            if self._lock_fd is None and not self._take_lock():
                self._stop.wait(self._retry_s)
                continue
            if not self._ready():
                # The listener is still connecting, or Redis is down: a ping now and then lets
                # the breaker tell (and `wait_caught_up` return) without waiting for it.
                if time.monotonic() >= next_probe:
                    self.link.call(lambda c: c.ping(), None)
                    next_probe = time.monotonic() + self._retry_s
                self._stop.wait(0.02)
                continue
            if check_reset:
                if not self._check_reset():
                    self._stop.wait(self._retry_s)
                    continue
                check_reset = False
            got: Any = self.link.call(self._read, _MISSING)
            if got is _MISSING:  # Redis is down (the breaker logged it): try again later
                check_reset = True
                self._stop.wait(self._retry_s)
                continue
            entries = _entries(got, self.key)
            if entries:
                try:
                    if self.store.disk_critical():  # as the host's own rows: none while short
                        raise DiskShort("the disk is under half of disk_headroom_bytes")
                    self._apply(entries)
                except (DiskShort, lmdb.Error, RuntimeError) as exc:
                    if not isinstance(exc, DiskShort) and not self.store.disk_error(exc):
                        self._apply_failed(len(entries))
                        self._stop.wait(self._retry_s)
                        continue
                    now = time.monotonic()  # they wait in Redis: the id is not advanced
                    if now - disk_logged_s >= 60.0:  # once a minute, not every retry
                        disk_logged_s = now
                        log.warning(
                            "semantic rows from Redis wait for disk (%s); retried every %.1f s",
                            exc,
                            self._retry_s,
                        )
                    self._stop.wait(self._retry_s)
                    continue
                except Exception:  # noqa: BLE001 - the thread must go on; the id is not advanced
                    self._apply_failed(len(entries))
                    self._stop.wait(self._retry_s)
                    continue
            if len(entries) < self._batch_rows and not self._cut and not self._caught_up.is_set():
                self._caught_up.set()
                log.info("semantic rows caught up from Redis (%s)", self._describe())

    def _read(self, client: Any) -> Any:
        """The rows after the last id read, bounded in size (`_BOUNDED_READ`), in XREAD's
        reply shape; an empty reply waits `block_s` first (the read itself never blocks)."""
        if self._script is None:
            self._script = client.register_script(_BOUNDED_READ)
        rows, cut = self._script(
            keys=[self.key],
            args=[f"({self._last_id}", self._batch_rows, MAX_ROW_BYTES, MAX_BATCH_BYTES],
            client=client,
        )
        self._cut = bool(cut)  # stopped at the byte budget: more rows follow at once
        if not rows:
            self._stop.wait(self._block_s)
            return []
        entries = [(entry_id, _pairs(fields)) for entry_id, fields in rows]
        return [[self.key, entries]]

    def _take_lock(self) -> bool:
        self._lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._lock_refused.set()
            return False
        self._lock_fd = fd
        self._lock_refused.clear()
        return True

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _check_reset(self) -> bool:
        """After a (re)connect: if the stream's newest id is older than the one this host
        stored, the stream was recreated (a Redis restored from an older snapshot): read it
        again from its start (duplicates are harmless). False when Redis is unavailable."""

        def newest(c: Any) -> str:
            if not c.exists(self.key):
                return ""
            info = c.xinfo_stream(self.key)
            value = info.get("last-generated-id", b"0-0")
            return value.decode() if isinstance(value, bytes) else str(value)

        found: Any = self.link.call(newest, _MISSING)
        if found is _MISSING:
            return False
        if found and _id_tuple(found) < _id_tuple(self._last_id):
            log.warning(
                "the semantic stream %s restarted (newest id %s < %s); reading it again",
                self.key,
                found,
                self._last_id,
            )
            self._last_id = "0-0"
        return True

    def _apply(self, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        counts = dict.fromkeys(self._counts, 0)
        counts["read"] = len(entries)
        rows: list[tuple[str, str, str, np.ndarray]] = []
        tenants: dict[str, str] = {}  # scope -> the answer's tenant scope (the per-tenant cap)
        now = self._clock()
        for _, fields in entries:
            if not fields_verify(self._signer, self.key, fields):
                counts["forged"] += 1
                continue
            try:
                row = SharedRow.from_fields(fields)
            except ValueError as exc:
                counts["malformed"] += 1
                log.debug("skipped a stream entry: %s", exc)
                continue
            if row.origin == self._origin:
                counts["own"] += 1
            elif (self._embedder and row.embedder != self._embedder) or (
                self._dimensions and len(row.vector) != self._dimensions
            ):
                counts["foreign"] += 1
            elif (row.expires_s and row.expires_s <= now) or self.invalidations.covers(
                row.digest, row.entry()
            ):
                counts["dead"] += 1
            else:
                rows.append((row.scope, row.digest, row.prompt, row.vector))
                tenants[row.scope] = row.tenant
        last_id = entries[-1][0]
        added = self._append(rows, {self._meta_key: last_id.encode()}, tenants)
        counts["added"] = added
        counts["duplicate"] = len(rows) - added
        self._last_id = last_id
        with self._stats_lock:
            for name, value in counts.items():
                self._counts[name] += value

    def _append(
        self,
        rows: list[tuple[str, str, str, np.ndarray]],
        meta: dict[bytes, bytes],
        tenants: dict[str, str],
    ) -> int:
        """Rows through the write path (log, then tables); how many were new. `tenants` names
        each row's tenant scope by scope (a new scope counts toward that tenant's cap). A batch
        the log refuses (a width that differs from the scope's, a new scope past a cap) is
        retried row by row, skipping those. Past the compaction mark it compacts first, and a
        compaction that fails leaves the batch unapplied (read again later): rows never take
        the log past its mark while compactions fail, or a full map could not even delete."""
        if self.store.compaction_due():
            self._compact()
        try:
            fresh = self._log(rows, meta, tenants)
        except ValueError:
            fresh = {}
            for i, row in enumerate(rows):
                try:
                    for tag, (seqs, vectors) in self._log([row], {}, tenants).items():
                        entry = fresh.setdefault(tag, ([], []))
                        entry[0].extend(seqs)
                        entry[1].extend(vectors)
                except ScopeLimitReached as exc:  # counted and logged once a minute, as locally
                    self.store.note_scope_refused(exc.reason)
                except ValueError as exc:
                    log.warning("skipped semantic row %d of a batch from Redis: %s", i, exc)
            self._log([], meta, {})
        for tag, (seqs, vectors) in fresh.items():
            self.store.tables.publish(tag, seqs, np.stack(vectors))
        if self.store.compaction_due():
            # as the llm stage's writes do: at the mark, while the map still has the free pages
            # deleting needs (a log this follower filled to the brim could not even delete)
            with contextlib.suppress(CompactionPending):  # these rows are in: the next
                self._compact()  # batch waits for the compaction instead
        return sum(len(seqs) for seqs, _ in fresh.values())

    def _apply_failed(self, rows: int) -> None:
        """Logged with its traceback at most once a minute (retried every `retry_s`: a
        compaction failing for as long as a tier cannot be read would log each retry)."""
        if self._apply_log.ready():
            log.exception(
                "applying %d semantic rows from Redis failed (%d more failures since the last "
                "line); retried every %.1f s",
                rows,
                self._apply_log.suppressed,
                self._retry_s,
            )

    def _compact(self) -> None:
        """Compact now (the log is past its mark); a compaction that failed less than
        `RETRY_PAUSE_S` ago is not run again: CompactionPending, and the batch waits."""
        if time.monotonic() - self._compact_failed_s < compaction.RETRY_PAUSE_S:
            raise CompactionPending("the semantic log's last compaction failed; tried again soon")
        started = time.perf_counter()
        try:
            deleted = self.store.compact(self._answer_exists, answer_value=self._answer_value)
        except Exception:
            self._compact_failed_s = time.monotonic()
            raise
        log.info(
            "semantic log compacted by the Redis row follower: %d rows deleted in %.1f s",
            deleted,
            time.perf_counter() - started,
        )

    def _log(
        self,
        rows: list[tuple[str, str, str, np.ndarray]],
        meta: dict[bytes, bytes],
        tenants: dict[str, str],
    ) -> dict[str, tuple[list[int], list[np.ndarray]]]:
        try:
            return self.store.log_rows(rows, meta, tenants=tenants)[1]
        except lmdb.MapFullError:
            self._compact()
            return self.store.log_rows(rows, meta, tenants=tenants)[1]

    def _describe(self) -> str:
        with self._stats_lock:
            counts = dict(self._counts)
        return ", ".join(f"{k} {v}" for k, v in counts.items()) + f", last id {self._last_id}"

    def stats(self) -> FollowerStats:
        with self._stats_lock:
            c = dict(self._counts)
        return FollowerStats(
            self._lock_fd is not None,
            self._caught_up.is_set(),
            c["read"],
            c["added"],
            c["duplicate"],
            c["own"],
            c["dead"],
            c["foreign"],
            c["malformed"],
            self._last_id,
            c["forged"],
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._release_lock()


def _entries(reply: Any, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """XREAD's reply for one stream as (id, fields): RESP2 `[[key, [(id, fields), ...]]]` (the
    client's default) or RESP3 `{key: [[(id, fields), ...]]}`."""
    out: list[tuple[str, dict[bytes, bytes]]] = []
    streams = reply.items() if isinstance(reply, dict) else (reply or [])
    for _, entries in streams:
        if entries and isinstance(entries[0], list):  # RESP3 wraps the entries once more
            entries = entries[0]
        for entry_id, fields in entries:
            ident = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
            if not _STREAM_ID.fullmatch(ident):  # not a Redis id: a hostile store's; skipped
                log.warning("skipping a semantic row whose stream id is malformed")
                continue
            out.append((ident, dict(fields or {})))
    return out


_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


def _pairs(flat: Any) -> dict[bytes, bytes]:
    """A stream entry's fields as Lua returns them (field, value, field, value, ...)."""
    items = list(flat or [])
    return {bytes(items[i]): bytes(items[i + 1]) for i in range(0, len(items) - 1, 2)}


def _id_tuple(stream_id: str) -> tuple[int, int]:
    """A stream id's two numbers; (0, 0) for one that is not an id (a hostile store's, kept by
    an older release): read again from the start, which is idempotent."""
    ms, _, seq = stream_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0


def follower_lock_path(semantic_path: Path) -> Path:
    """The host's follower lock, beside its row log."""
    return semantic_path / "redis-follower.lock"


class ListenerStatus(Protocol):
    """What RowSharing needs of the invalidation listener."""

    def stats(self) -> Any: ...


class RowSharing:
    """The llm stage's side of sharing: `publish` each row it indexes (with the metadata of the
    answer it just stored), and one `RowFollower` per host that takes in the others' rows."""

    def __init__(
        self,
        cache: TieredCache,
        store: SemanticStore,
        link: RedisLink,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        embedder: str = "",
        dimensions: int = 0,
        retry_s: float = 1.0,
        batch_rows: int = 512,
        listener: ListenerStatus | None = None,
    ) -> None:
        """`listener` is the process's invalidation listener: the follower takes rows in only
        while it is connected (None: always)."""
        self.cache = cache
        self.embedder = embedder
        self.publisher = RowPublisher(link, max_rows)
        self.follower = RowFollower(
            link,
            store,
            cache.invalidations,
            lock_path=follower_lock_path(store.path),
            ready=(lambda: listener.stats().connected) if listener is not None else lambda: True,
            answer_exists=cache.exists,  # strict: an unreadable tier stops a compaction
            answer_value=cache.answer_value,
            embedder=embedder,
            dimensions=dimensions,
            batch_rows=batch_rows,
            retry_s=retry_s,
        )

    def start(self) -> RowSharing:
        self.follower.start()
        return self

    def publish(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> bool:
        """Share a row just indexed here; False when its answer is gone already (invalidated
        meanwhile) or Redis is unavailable."""
        found = self.cache.get(digest, request=False)
        if found is None:
            return False
        row = SharedRow.of_entry(
            scope, digest, prompt, vector, self.embedder, found.entry, self.follower.origin
        )
        return self.publisher.publish(row)

    def close(self) -> None:
        """Stops the follower; the cache and store belong to the caller."""
        self.follower.close()
