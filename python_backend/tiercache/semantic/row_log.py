"""The host's semantic row log: an append-only LMDB log of (scope, answer digest, normalized
prompt, vector) rows, durable, and the source of every row's metadata.

Each row has a sequence number (`seq`) that never changes and is never given out again by this
log (`log_id` tells logs apart: a log rebuilt after damage starts again at 0). Per scope the log
also keeps the scope's live rows in seq order, one row per answer digest, the rows of digests
that were invalidated, and the manifest of the scope's current shared table (`TableManifest`).
Writers serialize on LMDB's write lock across processes.

Scopes are capped per host and per tenant (`RowLog`): each scope records the tenant scope that
started it, and each tenant its count of scopes, both written in the transaction that writes the
scope's first manifest, so the per-tenant check reads one key instead of walking the log.

It is the lowest layer of the semantic index and imports none of the others: the shared tables
that copy its vectors (`shared_rows`), compaction (`compaction`), the store that writes both
(`store`) and the search (`index`) all read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.exact.stores import check_readers, data_bytes, open_lmdb

log = logging.getLogger(__name__)

INITIAL_CAPACITY = 16  # rows; a scope's first table (its manifest written with its first row)
# Scopes one host's log holds at most. Each scope is a table file that every process searching
# it maps (one mmap each): about 65k would exhaust the default vm.max_map_count of 65,530.
DEFAULT_MAX_SCOPES = 4096
# Scopes one tenant scope may start on a host: scopes differ by model, adapter, sampling
# parameters and max_tokens, so one tenant alone could otherwise take every place of the host.
DEFAULT_MAX_SCOPES_PER_TENANT = 256
MAX_VECTOR_FLOATS = 1 << 16  # the widest row a shared table holds (tiercache_native)
NORM_TOLERANCE = 1e-3  # |norm - 1| a written vector may have: the search is a dot product
_REFUSED_LOG_INTERVAL_S = 60.0

_ROW_PREFIX = b"r"
_NEXT_KEY = b"meta:next"
_HEADER = struct.Struct("<16sdI")  # checksum, created_s, dimensions


@dataclass(frozen=True, slots=True)
class IndexRow:
    seq: int
    scope: str
    digest: str  # the exact-cache key of the answer this prompt produced
    prompt: str  # the normalized prompt (the guard compares texts)
    vector: np.ndarray
    created_s: float
    checksum: bytes = b""  # of the stored row's bytes (set when read back from the log)


@dataclass(frozen=True, slots=True)
class TableManifest:
    """Which table file is a scope's current one, as the row log records it."""

    scope: str
    epoch: int
    width: int
    capacity: int


class InvalidVector(ValueError):
    """A vector refused by the index: not a unit row of finite float32 of the right width."""


class ScopeLimitReached(ValueError):
    """A row of a new scope refused because the log already holds `max_scopes` scopes, or its
    tenant has started `max_scopes_per_tenant` of them (`reason` says which)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{reason}; a row of a new scope is not indexed")
        self.reason = reason


def check_vector(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """`vector` as one contiguous float32 row, or InvalidVector: its width must be 1 to
    `MAX_VECTOR_FLOATS` (and `dimensions`, when given), its values finite, and its norm 1
    within `NORM_TOLERANCE`, since similarities are plain dot products (cosine on unit
    vectors): a longer vector would outrank every true neighbour, a NaN would poison the scan."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow gives inf: refused below
            row = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise InvalidVector(f"not a vector of numbers: {exc}") from exc
    width = len(row)
    if not 1 <= width <= MAX_VECTOR_FLOATS:
        raise InvalidVector(f"a vector of {width} floats (1 to {MAX_VECTOR_FLOATS})")
    if dimensions is not None and width != dimensions:
        raise InvalidVector(f"a vector of {width} floats where the index has {dimensions}")
    if not np.isfinite(row).all():
        raise InvalidVector("a vector with NaN or infinite values")
    norm = float(np.linalg.norm(row.astype(np.float64)))
    if abs(norm - 1.0) > NORM_TOLERANCE:
        raise InvalidVector(
            f"a vector of norm {norm:.6g}, not 1 within {NORM_TOLERANCE:g} (the search "
            "compares unit vectors)"
        )
    return row


def _row_key(seq: int) -> bytes:
    return _ROW_PREFIX + seq.to_bytes(8, "big")


def encode_row(row: IndexRow) -> bytes:
    vector = np.ascontiguousarray(row.vector, dtype=np.float32).tobytes()
    meta = json.dumps(
        {"scope": row.scope, "digest": row.digest, "prompt": row.prompt}, ensure_ascii=False
    ).encode("utf-8")
    body = vector + meta
    checksum = hashlib.sha256(body).digest()[:16]
    return _HEADER.pack(checksum, row.created_s, len(row.vector)) + body


def decode_row(seq: int, blob: bytes) -> IndexRow | None:
    """The row, or None when its bytes are damaged (a damaged row is skipped, never served)."""
    if len(blob) < _HEADER.size:
        return None
    checksum, created_s, dimensions = _HEADER.unpack_from(blob)
    body = bytes(blob[_HEADER.size :])
    if hashlib.sha256(body).digest()[:16] != checksum or len(body) < 4 * dimensions:
        return None
    vector = np.frombuffer(body[: 4 * dimensions], dtype=np.float32).copy()
    try:
        meta = json.loads(body[4 * dimensions :].decode("utf-8"))
        fields = meta["scope"], meta["digest"], meta["prompt"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
        return None
    # a checksum that holds over fields of other types (not written by encode_row) would
    # stop compaction and every lookup that chose the row: damaged, skipped like the rest
    if not all(isinstance(field, str) for field in fields) or not math.isfinite(created_s):
        return None
    return IndexRow(seq, *fields, vector, created_s, checksum)


_SCOPE_ROW = b"x"  # x<tag><seq>: the scope's live rows, in seq order
_DIGEST = b"g"  # g<tag><digest>: the scope's row for an answer digest (one row per digest)
_LIVE = b"n"  # n<tag>: how many live rows the scope has
_MANIFEST = b"t"  # t<tag>: the scope's current table (TableManifest)
_FORGOTTEN = b"f"  # f<tag><digest>: seqs (8 bytes each) of the digest's invalidated rows
_LOG_ID_KEY = b"meta:log"
_META_PREFIX = b"meta:"  # the log's own values (not rows); see log_rows(meta=...)
_OWNER = b"o"  # o<tag>: the tag (`scope_tag`) of the tenant scope that started the scope
_TENANT_SCOPES = b"c"  # c<tenant tag>: how many scopes the tenant started (`o` keys naming it)
# k<seq>: the claim count (`_CLAIMS_KEY`) when `log_rows` last handed this existing row back
# for an answer stored again: a compaction that scanned before it spares the row
_CLAIMED = b"k"
_CLAIMS_KEY = b"meta:claims"
# An answer digest's most bytes (a hex SHA-256 has 64): the digest is part of an LMDB key,
# which holds at most 511 bytes, and a longer one failed the whole batch's transaction
MAX_DIGEST_BYTES = 128
_MANIFEST_HEAD = struct.Struct("<QIQ")  # epoch, width, capacity; then the scope, UTF-8


def scope_tag(scope: str) -> str:
    """A scope's name in the log's keys, its table files and its graph files."""
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()[:24]


def _checked_digest(digest: str) -> str:
    """`digest`, or ValueError when it is longer than MAX_DIGEST_BYTES (or not text)."""
    if not isinstance(digest, str) or len(digest.encode("utf-8")) > MAX_DIGEST_BYTES:
        shown = repr(digest)[:40]
        raise ValueError(f"an answer digest of at most {MAX_DIGEST_BYTES} bytes, got {shown}")
    return digest


def _tag_bytes(scope: str) -> bytes:
    return bytes.fromhex(scope_tag(scope))


def _count(raw: bytes | None) -> int:
    return int.from_bytes(raw, "big") if raw else 0


class RowLog:
    """The host's semantic rows in an append-only LMDB log at `path` (see the module docstring).
    Every method is one LMDB transaction, safe from any thread and process.

    Every vector written is checked (`check_vector`; `dimensions` when given), and the log
    holds at most `max_scopes` scopes, of which one tenant scope may start at most
    `max_scopes_per_tenant` (scopes differ by model, adapter, sampling parameters and
    max_tokens, so one tenant could otherwise take every place and starve the others): a row
    that would start one more is refused (`ScopeLimitReached`;
    `SemanticStore.append_or_compact` counts it in `scopes_refused` instead), never an existing
    scope's row, whoever's it is.

    A row names the tenant scope that would start its scope (`log_rows(tenants=...)`; "" for
    none: such rows count under the tenant ""). The log keeps each tenant's count in one key,
    updated in the transaction that writes a scope's first manifest (and lowered when an empty
    scope's manifest is dropped), so the check reads one key. Scopes of a log written before
    the counts existed belong to no tenant: they count toward `max_scopes` only, and are not
    migrated."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = 2 << 30,
        clock: Callable[[], float] = time.time,
        *,
        dimensions: int | None = None,
        max_scopes: int = DEFAULT_MAX_SCOPES,
        max_scopes_per_tenant: int = DEFAULT_MAX_SCOPES_PER_TENANT,
    ) -> None:
        if max_scopes < 1:
            raise ValueError(f"max_scopes must be at least 1, got {max_scopes}")
        if max_scopes_per_tenant < 1:
            raise ValueError(
                f"max_scopes_per_tenant must be at least 1, got {max_scopes_per_tenant}"
            )
        self.path = path
        self.dimensions = dimensions
        self.max_scopes = max_scopes
        self.max_scopes_per_tenant = max_scopes_per_tenant
        self.scopes_refused = 0
        self._refused_lock = threading.Lock()
        self._refused_logged_s = -_REFUSED_LOG_INTERVAL_S
        # Damaged while stopped (truncated, overwritten): moved aside with its tables, rebuilt.
        # Created 0700 with 0600 files; dead readers' slots freed (`open_lmdb`).
        self._env = open_lmdb(path, max_bytes, "semantic row log", clock)
        self._clock = clock
        with self._env.begin(write=True) as txn:
            log_id = txn.get(_LOG_ID_KEY)
            if log_id is None:
                log_id = uuid.uuid4().bytes
                txn.put(_LOG_ID_KEY, log_id)
            self.log_id: bytes = bytes(log_id)

    def data_bytes(self) -> int:
        """Bytes of the log's map in use by data pages (what compaction is measured against)."""
        return data_bytes(self._env)

    def reader_check(self) -> int:
        """Free reader slots of dead processes (done at open too); how many."""
        return check_readers(self._env, "semantic row log", self.path)

    def admits_scope(self, scope: str, tenant: str = "") -> bool:
        """Whether a row of `scope` would be taken (`scope_refusal` is None)."""
        return self.scope_refusal(scope, tenant) is None

    def scope_refusal(self, scope: str, tenant: str = "") -> str | None:
        """None when a row of `scope` would be taken: the scope exists, or the log holds fewer
        than `max_scopes` scopes and `tenant` (the tenant scope that would start it) has
        started fewer than `max_scopes_per_tenant`; else why not. (Another process may take
        the last place meanwhile: `log_rows` checks again.)"""
        with self._env.begin() as txn:
            if self._manifest(txn, _tag_bytes(scope)) is not None:
                return None
            return self._new_scope_refusal(txn, tenant)

    def note_scope_refused(self, reason: str) -> None:
        """Count a row not indexed because its new scope would pass a cap (`reason`, from
        `scope_refusal` or `ScopeLimitReached.reason`); logged at most once a minute."""
        with self._refused_lock:
            self.scopes_refused += 1
            now = time.monotonic()
            if now - self._refused_logged_s < _REFUSED_LOG_INTERVAL_S:
                return
            self._refused_logged_s = now
            refused = self.scopes_refused
        log.warning(
            "semantic log %s: %s; rows of new scopes past it are not indexed (%d so far, "
            "logged at most once a minute)",
            self.path,
            reason,
            refused,
        )

    def scopes_started_by(self, tenant: str) -> int:
        """How many scopes of the log `tenant` started (scopes from before the counts existed
        belong to no tenant)."""
        with self._env.begin() as txn:
            return _count(txn.get(_TENANT_SCOPES + _tag_bytes(tenant)))

    def _new_scope_refusal(self, txn: Any, tenant: str) -> str | None:
        """Why a new scope started by `tenant` would pass a cap, or None."""
        if _count(txn.get(_TENANT_SCOPES + _tag_bytes(tenant))) >= self.max_scopes_per_tenant:
            return (
                f"tenant scope {tenant[:8]!r} holds its limit of {self.max_scopes_per_tenant} "
                "scopes on this host"
            )
        if self._count_scopes(txn, self.max_scopes) >= self.max_scopes:
            return f"the log holds its limit of {self.max_scopes} scopes"
        return None

    @staticmethod
    def _start_scope(txn: Any, tag: bytes, manifest: TableManifest, tenant: str) -> None:
        """Write a new scope's manifest, its tenant and the tenant's count, in `txn`."""
        tenant_tag = _tag_bytes(tenant)
        count_key = _TENANT_SCOPES + tenant_tag
        txn.put(_MANIFEST + tag, _encode_manifest(manifest))
        txn.put(_OWNER + tag, tenant_tag)
        txn.put(count_key, (_count(txn.get(count_key)) + 1).to_bytes(8, "big"))

    @staticmethod
    def _end_scope(txn: Any, tag: bytes) -> None:
        """Give the place of a scope whose manifest was dropped back to its tenant, in `txn`
        (a scope from before the counts has no tenant: nothing to give back)."""
        tenant_tag = txn.get(_OWNER + tag)
        if tenant_tag is None:
            return
        txn.delete(_OWNER + tag)
        count_key = _TENANT_SCOPES + bytes(tenant_tag)
        txn.put(count_key, max(0, _count(txn.get(count_key)) - 1).to_bytes(8, "big"))

    @staticmethod
    def _count_scopes(txn: Any, stop_at: int) -> int:
        """Scopes with a manifest, counted up to `stop_at`: a walk over at most that many
        keys, done only when a row would start a new scope (no stored count to keep right)."""
        count = 0
        cursor = txn.cursor()
        if cursor.set_range(_MANIFEST):
            for key in cursor.iternext(values=False):
                if not key.startswith(_MANIFEST) or count >= stop_at:
                    break
                count += 1
        return count

    def scan(self) -> Iterator[tuple[int, IndexRow | None]]:
        """Every row in seq order, None for a damaged one, from one read transaction that stays
        open while the caller iterates (a consistent view of the whole log)."""
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_ROW_PREFIX):
                return
            for key, blob in cursor:
                if not key.startswith(_ROW_PREFIX):
                    break
                seq = int.from_bytes(key[1:], "big")
                yield seq, decode_row(seq, blob)

    def claims_mark(self) -> int:
        """How many times `log_rows` has handed an existing row back for an answer stored
        again: a compaction reads it before its scan, and `delete_compacted` spares the rows
        claimed since (their answer came back after the scan judged it gone)."""
        with self._env.begin() as txn:
            raw = txn.get(_CLAIMS_KEY)
        return int.from_bytes(raw, "big") if raw else 0

    def delete_compacted(
        self,
        rows: Sequence[tuple[int, tuple[str, str] | None]],
        spare_claimed_after: int | None = None,
    ) -> tuple[int, set[str]]:
        """Compaction's delete: rows given as (seq, (scope, digest)), or (seq, None) for a
        damaged row, go with their scope entries (and the digest key, when it still names the
        row) in one write transaction; with `spare_claimed_after` (`claims_mark` before the
        scan), not those `log_rows` handed back since. Returns how many rows were deleted and
        the tags of the scopes touched, whose tables must then be synced."""
        touched: set[str] = set()
        deleted = 0
        with self._env.begin(write=True) as txn:
            for seq, brief in rows:
                claimed = txn.get(_CLAIMED + seq.to_bytes(8, "big"))
                if (
                    spare_claimed_after is not None
                    and claimed is not None
                    and int.from_bytes(claimed, "big") > spare_claimed_after
                ):
                    continue  # its answer was stored again after the scan: it lives
                if claimed is not None:
                    txn.delete(_CLAIMED + seq.to_bytes(8, "big"))
                deleted += bool(txn.delete(_row_key(seq)))
                if brief is None:  # damaged: its scope is unknown, so looked for in each
                    touched |= self._unindex_anywhere(txn, seq)
                else:
                    scope, digest = brief
                    tag = _tag_bytes(scope)
                    self._unindex(txn, tag, seq)
                    digest_key = _DIGEST + tag + digest.encode("utf-8")
                    if txn.get(digest_key) == seq.to_bytes(8, "big"):
                        txn.delete(digest_key)
                    self._unforget(txn, _FORGOTTEN + tag + digest.encode("utf-8"), seq)
                    touched.add(tag.hex())
        return deleted, touched

    def _unindex_anywhere(self, txn: Any, seq: int) -> set[str]:
        """Take `seq` off whichever scope lists it (a damaged row names none; a scope's sync
        reads only the rows its table lacks, so the entry stayed, counted live, for good):
        one lookup per scope, for rows that bit rot damaged (rare: a batch of 64 of them
        over 4,096 scopes is 262,144 lookups inside the write transaction). The tags
        touched."""
        tags = []
        cursor = txn.cursor()
        if cursor.set_range(_MANIFEST):
            for key in cursor.iternext(values=False):
                if not key.startswith(_MANIFEST):
                    break
                tags.append(bytes(key[len(_MANIFEST) :]))
        touched = set()
        for tag in tags:
            if txn.get(_SCOPE_ROW + tag + seq.to_bytes(8, "big")) is not None:
                self._unindex(txn, tag, seq)
                touched.add(tag.hex())
        return touched

    @staticmethod
    def _unforget(txn: Any, key: bytes, seq: int) -> None:
        """Take a deleted row's seq off its digest's forgotten list (the list goes when empty):
        the lists grew with every invalidated digest and nothing freed them."""
        listed = txn.get(key)
        if not listed:
            return
        mine = seq.to_bytes(8, "big")
        kept = b"".join(
            listed[i : i + 8] for i in range(0, len(listed), 8) if listed[i : i + 8] != mine
        )
        if kept:
            txn.put(key, kept)
        else:
            txn.delete(key)

    def superseded(self, rows: Sequence[tuple[int, tuple[str, str] | None]]) -> set[int]:
        """The seqs of `rows` (seq, (scope, digest)) whose digest's key in their scope names
        another row, or none: rows an invalidation made forgotten (`forget_digests`), kept
        live until now and duplicated when the answer was indexed again. One read
        transaction."""
        found: set[int] = set()
        with self._env.begin() as txn:
            for seq, brief in rows:
                if brief is None:
                    continue
                scope, digest = brief
                named = txn.get(_DIGEST + _tag_bytes(scope) + digest.encode("utf-8"))
                if named != seq.to_bytes(8, "big"):
                    found.add(seq)
        return found

    @staticmethod
    def _unindex(txn: Any, tag: bytes, seq: int) -> None:
        if txn.delete(_SCOPE_ROW + tag + seq.to_bytes(8, "big")):
            raw = txn.get(_LIVE + tag)
            live = int.from_bytes(raw, "big") if raw else 0
            txn.put(_LIVE + tag, max(0, live - 1).to_bytes(8, "big"))

    def log_rows(
        self,
        rows: list[tuple[str, str, str, np.ndarray]],
        meta: dict[bytes, bytes] | None = None,
        *,
        tenants: Mapping[str, str] | None = None,
    ) -> tuple[list[int], dict[str, tuple[list[int], list[np.ndarray]]]]:
        """The log half of `SemanticStore.append_many`: the seqs, and the new rows by scope tag,
        to publish. `meta` (keys under `meta:`) is written in the same transaction as the rows:
        a reader of a shared stream records how far it has read together with what it read.
        `tenants` names, by scope, the tenant scope a row of a new scope starts it for (the
        scope's tenant; a scope not named: ""); it matters only for scopes not yet in the log.

        All or nothing: InvalidVector for a vector `check_vector` refuses, ValueError for a
        digest longer than MAX_DIGEST_BYTES, ScopeLimitReached for a row that would start a
        scope past `max_scopes` or past its tenant's `max_scopes_per_tenant` (all
        ValueError)."""
        seqs: list[int] = []
        fresh: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        rows = [
            (scope, _checked_digest(digest), prompt, check_vector(vector, self.dimensions))
            for scope, digest, prompt, vector in rows
        ]
        with self._env.begin(write=True) as txn:
            for key, value in (meta or {}).items():
                if not key.startswith(_META_PREFIX):
                    raise ValueError(f"a log meta key must start with {_META_PREFIX!r}: {key!r}")
                txn.put(key, value)
            raw = txn.get(_NEXT_KEY)
            seq = int.from_bytes(raw, "big") if raw else 0
            for scope, digest, prompt, vector in rows:
                tag = _tag_bytes(scope)
                digest_key = _DIGEST + tag + digest.encode("utf-8")
                known = txn.get(digest_key)
                if known is not None and txn.get(_ROW_PREFIX + known) is not None:
                    seqs.append(int.from_bytes(known, "big"))
                    raw_claims = txn.get(_CLAIMS_KEY)
                    claims = (int.from_bytes(raw_claims, "big") if raw_claims else 0) + 1
                    txn.put(_CLAIMS_KEY, claims.to_bytes(8, "big"))
                    txn.put(_CLAIMED + bytes(known), claims.to_bytes(8, "big"))
                    continue
                manifest = self._manifest(txn, tag)
                if manifest is None:
                    tenant = (tenants or {}).get(scope, "")
                    refusal = self._new_scope_refusal(txn, tenant)
                    if refusal is not None:
                        raise ScopeLimitReached(refusal)
                    manifest = TableManifest(scope, 0, len(vector), INITIAL_CAPACITY)
                    self._start_scope(txn, tag, manifest, tenant)
                elif manifest.width != len(vector):
                    raise ValueError(
                        f"a vector of {len(vector)} floats for a scope of {manifest.width}"
                    )
                row = IndexRow(seq, scope, digest, prompt, vector, self._clock())
                txn.put(_row_key(seq), encode_row(row))
                txn.put(_SCOPE_ROW + tag + seq.to_bytes(8, "big"), b"")
                raw_live = txn.get(_LIVE + tag)
                live = int.from_bytes(raw_live, "big") if raw_live else 0
                txn.put(_LIVE + tag, (live + 1).to_bytes(8, "big"))
                txn.put(digest_key, seq.to_bytes(8, "big"))
                seqs.append(seq)
                entry = fresh.setdefault(tag.hex(), ([], []))
                entry[0].append(seq)
                entry[1].append(vector)
                seq += 1
            txn.put(_NEXT_KEY, seq.to_bytes(8, "big"))
        return seqs, fresh

    def meta(self, key: bytes) -> bytes | None:
        """A value `log_rows` wrote under `meta`, or None."""
        with self._env.begin() as txn:
            raw = txn.get(key)
        return None if raw is None else bytes(raw)

    def head(self) -> int:
        """The next sequence number: rows [0, head) have been written."""
        with self._env.begin() as txn:
            raw = txn.get(_NEXT_KEY)
        return int.from_bytes(raw, "big") if raw else 0

    def rows_since(self, seq: int) -> Iterator[IndexRow]:
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(_row_key(seq)):
                return
            for key, blob in cursor:
                if not key.startswith(_ROW_PREFIX):
                    break
                row = decode_row(int.from_bytes(key[1:], "big"), blob)
                if row is not None:
                    yield row

    def rows(self, seqs: Sequence[int]) -> list[IndexRow | None]:
        """The rows with these seqs, in one read; None for one deleted or damaged."""
        with self._env.begin() as txn:
            return [
                None if (blob := txn.get(_row_key(seq))) is None else decode_row(seq, blob)
                for seq in seqs
            ]

    def read_vectors(self, seqs: list[int], width: int) -> tuple[np.ndarray, list[int]]:
        """The vectors of these rows (in order) and the seqs that could not be read (damaged,
        deleted or of another width), which are left out of the vectors."""
        vectors: list[np.ndarray] = []
        bad: list[int] = []
        for seq, row in zip(seqs, self.rows(seqs), strict=True):
            if row is None or len(row.vector) != width:
                bad.append(seq)
            else:
                vectors.append(row.vector)
        return (np.stack(vectors) if vectors else np.zeros((0, width), np.float32)), bad

    def present_digests(
        self, scopes: Mapping[str, int], digests: Sequence[str]
    ) -> dict[str, list[str]]:
        """Which of `digests` each scope holds a row or a forgotten list for: tag -> those
        digests, sorted (scopes without one left out). `scopes` maps a scope's tag to about how
        many rows it has: a scope with fewer rows than digests wanted has its keys read in
        order, a larger one is asked digest by digest, so a scope costs the smaller of the two.
        One read transaction: no writer of any process waits for it."""
        wanted = {d.encode("utf-8") for d in digests}
        found: dict[str, list[str]] = {}
        with self._env.begin() as txn:
            for tag, rows in scopes.items():
                scope = bytes.fromhex(tag)
                hits: set[bytes] = set()
                if rows < len(wanted):
                    cursor = txn.cursor()
                    for prefix in (_DIGEST + scope, _FORGOTTEN + scope):
                        if not cursor.set_range(prefix):
                            continue
                        for key in cursor.iternext(values=False):
                            if not key.startswith(prefix):
                                break
                            if key[len(prefix) :] in wanted:
                                hits.add(key[len(prefix) :])
                else:
                    hits = {
                        d
                        for d in wanted
                        if txn.get(_DIGEST + scope + d) is not None
                        or txn.get(_FORGOTTEN + scope + d) is not None
                    }
                if hits:
                    found[tag] = sorted(h.decode("utf-8") for h in hits)
        return found

    def forget_digests(self, tag: str, digests: list[str]) -> list[int]:
        """The rows of these answer digests that were forgotten in scope `tag`: each digest's
        current row moves to its forgotten list (`f` keys) and loses the digest key, so the
        same digest appended again gets a new row. Idempotent across processes."""
        scope = bytes.fromhex(tag)
        seqs: list[int] = []
        with self._env.begin(write=True) as txn:
            for digest in digests:
                encoded = digest.encode("utf-8")
                forgotten_key = _FORGOTTEN + scope + encoded
                known = txn.get(_DIGEST + scope + encoded)
                listed = txn.get(forgotten_key) or b""
                if known is not None:
                    listed += known
                    txn.put(forgotten_key, listed)
                    txn.delete(_DIGEST + scope + encoded)
                seqs += [int.from_bytes(listed[i : i + 8], "big") for i in range(0, len(listed), 8)]
        return seqs

    def delete_rows(self, tag: str, seqs: list[int]) -> None:
        with self._env.begin(write=True) as txn:
            for seq in seqs:
                txn.delete(_row_key(seq))
                txn.delete(_CLAIMED + seq.to_bytes(8, "big"))
                self._unindex(txn, bytes.fromhex(tag), seq)

    def scope_seqs(self, tag: str) -> list[int]:
        """The scope's live rows, in seq order."""
        prefix = _SCOPE_ROW + bytes.fromhex(tag)
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return []
            seqs = []
            for key in cursor.iternext(values=False):
                if not key.startswith(prefix):
                    break
                seqs.append(int.from_bytes(key[len(prefix) :], "big"))
            return seqs

    def live_count(self, tag: str) -> int:
        with self._env.begin() as txn:
            raw = txn.get(_LIVE + bytes.fromhex(tag))
        return int.from_bytes(raw, "big") if raw else 0

    def manifest(self, tag: str) -> TableManifest | None:
        with self._env.begin() as txn:
            return self._manifest(txn, bytes.fromhex(tag))

    @staticmethod
    def _manifest(txn: Any, tag: bytes) -> TableManifest | None:
        raw = txn.get(_MANIFEST + tag)
        if raw is None:
            return None
        epoch, width, capacity = _MANIFEST_HEAD.unpack_from(raw)
        return TableManifest(bytes(raw[_MANIFEST_HEAD.size :]).decode(), epoch, width, capacity)

    def drop_manifest_if_empty(self, tag: str) -> bool:
        """Forget an empty scope's table (its manifest), in the transaction that sees it empty,
        and give its place back to its tenant: a row appended after it starts the scope again
        with a new table (and counts again)."""
        key = bytes.fromhex(tag)
        with self._env.begin(write=True) as txn:
            raw = txn.get(_LIVE + key)
            if raw and int.from_bytes(raw, "big"):
                return False
            if not txn.delete(_MANIFEST + key):
                return False
            self._end_scope(txn, key)
            return True

    def set_manifest(self, tag: str, manifest: TableManifest) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(_MANIFEST + bytes.fromhex(tag), _encode_manifest(manifest))

    def manifests(self) -> list[tuple[str, TableManifest]]:
        """Every scope's (tag, manifest)."""
        found = []
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(_MANIFEST):
                for key, _ in cursor:
                    if not key.startswith(_MANIFEST):
                        break
                    manifest = self._manifest(txn, key[1:])
                    if manifest is not None:
                        found.append((bytes(key[1:]).hex(), manifest))
        return found

    def close(self) -> None:
        self._env.close()


def _encode_manifest(manifest: TableManifest) -> bytes:
    head = _MANIFEST_HEAD.pack(manifest.epoch, manifest.width, manifest.capacity)
    return head + manifest.scope.encode("utf-8")
