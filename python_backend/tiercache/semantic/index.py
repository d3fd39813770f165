"""The semantic index: prompt vectors of cached answers, searched only inside their scope.

Rows live in an append-only LMDB log on the host (`SemanticStore`): durable, and the source of
each row's scope, answer digest and normalized prompt. Each scope's vectors are also published
to a shared table of the host (`tiercache_native.SharedTable`, see `shared_rows`), with the
row's log sequence number as its id, so every process searches the same rows without copying
them or catching up on the log: a search takes the table's snapshot (zero copy, an acquire load
of its count), scans it, and reads only the top k rows' metadata from the log.

Inside a scope the search is a flat matrix-vector product up to `flat_max_rows` rows, and an
HNSW graph (hnswlib) beyond, per process, fed from the table (rows not yet in it are scanned
flat). Building a large scope's graph dominates a start (about 12 s for 100,000 rows on 2
cores), so graphs are saved next to the row log (`GraphFiles`) and a start loads the newest one
that covers a prefix of the table's rows, then adds only the rows after it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import tiercache_native as native

from tiercache.semantic.shared_rows import INITIAL_CAPACITY, ScopeTables, TableManifest
from tiercache.stores import data_bytes, open_lmdb

log = logging.getLogger(__name__)

_ROW_PREFIX = b"r"
_MAX_PENDING = 10_000  # rows waiting for a background compaction (SemanticStore)
_COMPACTION_ROUNDS = 3  # compactions in a row before the waiting rows are dropped
_COMPACT_AT_FRACTION = 0.6  # of the log's map, in data pages: compaction starts there
_BUILD_RETRY_S = 60.0  # a scope whose graph build failed scans flat this long before a retry
_COMPACT_BATCH = 64  # rows deleted per write transaction by a compaction
_APPEND_BATCH = 16  # rows that waited for a compaction, appended per transaction after it
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
class Neighbour:
    similarity: float
    digest: str
    prompt: str


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
        return IndexRow(
            seq, meta["scope"], meta["digest"], meta["prompt"], vector, created_s, checksum
        )
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None


_SCOPE_ROW = b"x"  # x<tag><seq>: the scope's live rows, in seq order
_DIGEST = b"g"  # g<tag><digest>: the scope's row for an answer digest (one row per digest)
_LIVE = b"n"  # n<tag>: how many live rows the scope has
_MANIFEST = b"t"  # t<tag>: the scope's current table (TableManifest)
_FORGOTTEN = b"f"  # f<tag><digest>: seqs (8 bytes each) of the digest's invalidated rows
_LOG_ID_KEY = b"meta:log"
_META_PREFIX = b"meta:"  # the log's own values (not rows); see log_rows(meta=...)
_MANIFEST_HEAD = struct.Struct("<QIQ")  # epoch, width, capacity; then the scope, UTF-8


def _tag_bytes(scope: str) -> bytes:
    return bytes.fromhex(scope_tag(scope))


class SemanticStore:
    """The host's semantic rows: an append-only log in LMDB (durable, the source of each row's
    scope, digest and prompt; LMDB serializes writers across processes) and, per scope, a
    shared table of the vectors (`ScopeTables`) that readers scan without copying.

    A write appends to the log first, then publishes to the scope's table; a writer that dies
    between the two leaves a row the next publish to that scope (or the next process that
    opens the table) publishes. `tables_path` defaults to `<path>/tables`; it may be anywhere
    on the host (e.g. under /dev/shm) as long as every process of the host passes the same."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = 2 << 30,
        clock: Callable[[], float] = time.time,
        tables_path: Path | None = None,
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Damaged while stopped (truncated, overwritten): moved aside with its tables, rebuilt.
        self._env = open_lmdb(path, max_bytes, "semantic row log", clock)
        self._compact_at_bytes = int(max_bytes * _COMPACT_AT_FRACTION)
        self._clock = clock
        with self._env.begin(write=True) as txn:
            log_id = txn.get(_LOG_ID_KEY)
            if log_id is None:
                log_id = uuid.uuid4().bytes
                txn.put(_LOG_ID_KEY, log_id)
            self.log_id: bytes = bytes(log_id)
        self.tables = ScopeTables(self, tables_path or path / "tables")
        # Compaction runs on one background thread per process; rows that find the log full
        # meanwhile wait for it in `_pending` (bounded) and are appended after it.
        self._compaction_lock = threading.Lock()
        self._pending: list[tuple[str, str, str, np.ndarray]] = []
        self._compactor: threading.Thread | None = None

    def append(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> int:
        return self.append_many([(scope, digest, prompt, vector)])[0]

    def append_or_compact(
        self,
        scope: str,
        digest: str,
        prompt: str,
        vector: np.ndarray,
        answer_exists: Callable[[str], bool],
    ) -> int | None:
        """Append and return the row's seq; None when the log is full or being compacted.
        Once the log's data pages pass `_COMPACT_AT_FRACTION` of its map (or it is full), a
        background compaction starts (one per process): rows whose answer is gone are
        dropped (else the oldest tenth) and the touched scopes' tables rewritten. Rows that
        arrive while it runs wait (LMDB copies every page it changes, so compaction needs
        free pages even to delete) and are appended after it (at most `_MAX_PENDING`; more
        are dropped: a row missing costs a later semantic hit, never a wrong one). The
        caller, a miss's write-back, never waits for it: compacting a large log takes
        seconds."""
        row = (scope, digest, prompt, vector)
        with self._compaction_lock:
            if self._compactor is not None:
                if len(self._pending) < _MAX_PENDING:
                    self._pending.append(row)
                return None
        seq: int | None = None
        try:
            seq = self.append(scope, digest, prompt, vector)
        except lmdb.MapFullError:
            pass
        if seq is not None and data_bytes(self._env) < self._compact_at_bytes:
            return seq
        with self._compaction_lock:
            if seq is None and len(self._pending) < _MAX_PENDING:
                self._pending.append(row)
            if self._compactor is None:
                self._compactor = threading.Thread(
                    target=self._compact_then_append,
                    args=(answer_exists,),
                    name="semantic-compaction",
                    daemon=True,
                )
                self._compactor.start()
        return seq

    def _compact_then_append(self, answer_exists: Callable[[str], bool]) -> None:
        """Compact, then append the rows that waited, `_APPEND_BATCH` at a time, until none
        is left; if the log fills again first, compact again, at most `_COMPACTION_ROUNDS`
        times, then drop what still waits (logged)."""
        for _ in range(_COMPACTION_ROUNDS):
            started = time.perf_counter()
            try:
                deleted = self.compact(answer_exists)
                log.info(
                    "semantic log compacted: %d rows deleted in %.1f s", deleted, _since(started)
                )
            except Exception:  # noqa: BLE001 - the waiting rows are tried anyway
                log.exception("compacting the semantic log failed")
            while True:
                with self._compaction_lock:
                    if not self._pending:
                        self._compactor = None
                        return
                if data_bytes(self._env) >= self._compact_at_bytes:
                    break  # past the mark again: compact before the rest
                with self._compaction_lock:
                    batch = self._pending[:_APPEND_BATCH]
                    del self._pending[: len(batch)]
                try:
                    self.append_many(batch)
                except lmdb.MapFullError:
                    with self._compaction_lock:
                        self._pending[:0] = batch
                    break  # full again: another round
                except Exception:  # noqa: BLE001 - rows lost: fewer semantic hits, logged
                    log.exception("appending %d rows after compaction failed", len(batch))
        with self._compaction_lock:
            dropped, self._pending = len(self._pending), []
            self._compactor = None
        log.warning("semantic log still full after compaction: %d rows not indexed", dropped)

    def wait_compacted(self, timeout_s: float = 60.0) -> bool:
        """Wait for a running background compaction (and its appends); False on timeout."""
        with self._compaction_lock:
            compactor = self._compactor
        if compactor is not None:
            compactor.join(timeout_s)
            return not compactor.is_alive()
        return True

    def compact(self, answer_exists: Callable[[str], bool], fallback_fraction: float = 0.1) -> int:
        """Delete rows whose answer no longer exists; if none, the oldest `fallback_fraction`.
        Then each touched scope's table is rewritten without them (the old one retired).
        Keeps only each row's scope and digest in memory (not its vector), and deletes in
        transactions of `_COMPACT_BATCH` rows: LMDB copies the pages it changes, so one
        transaction over a nearly full map could not even delete."""
        dead: list[tuple[int, tuple[str, str] | None]] = []
        rows: list[tuple[int, tuple[str, str] | None]] = []
        with self._env.begin() as txn:
            cursor = txn.cursor()
            if cursor.set_range(_ROW_PREFIX):
                for key, blob in cursor:
                    if not key.startswith(_ROW_PREFIX):
                        break
                    seq = int.from_bytes(key[1:], "big")
                    row = decode_row(seq, blob)
                    brief = None if row is None else (row.scope, row.digest)
                    rows.append((seq, brief))
                    if row is None or not answer_exists(row.digest):
                        dead.append((seq, brief))
        if not dead:
            dead = rows[: max(1, int(len(rows) * fallback_fraction))]  # rows are in seq order
        del rows
        touched: set[bytes] = set()
        deleted = 0
        for start in range(0, len(dead), _COMPACT_BATCH):
            with self._env.begin(write=True) as txn:
                for seq, brief in dead[start : start + _COMPACT_BATCH]:
                    deleted += bool(txn.delete(_row_key(seq)))
                    if brief is not None:  # a damaged row's scope entry goes at its next sync
                        scope, digest = brief
                        tag = _tag_bytes(scope)
                        self._unindex(txn, tag, seq)
                        digest_key = _DIGEST + tag + digest.encode("utf-8")
                        if txn.get(digest_key) == seq.to_bytes(8, "big"):
                            txn.delete(digest_key)
                        touched.add(tag)
        for tag in touched:
            with self.tables.locked(tag.hex()):
                synced = self.tables.sync_scope(tag.hex())
                if synced is not None:
                    synced.close()
        return deleted

    @staticmethod
    def _unindex(txn: Any, tag: bytes, seq: int) -> None:
        if txn.delete(_SCOPE_ROW + tag + seq.to_bytes(8, "big")):
            raw = txn.get(_LIVE + tag)
            live = int.from_bytes(raw, "big") if raw else 0
            txn.put(_LIVE + tag, max(0, live - 1).to_bytes(8, "big"))

    def append_many(self, rows: list[tuple[str, str, str, np.ndarray]]) -> list[int]:
        """Append (scope, digest, prompt, vector) rows in one transaction (one fsync), then
        publish them to their scopes' tables. A digest the scope already has keeps its row
        (the returned seq is that row's)."""
        seqs, fresh = self.log_rows(rows)
        for tag, (new_seqs, vectors) in fresh.items():
            self.tables.publish(tag, new_seqs, np.stack(vectors))
        return seqs

    def log_rows(
        self,
        rows: list[tuple[str, str, str, np.ndarray]],
        meta: dict[bytes, bytes] | None = None,
    ) -> tuple[list[int], dict[str, tuple[list[int], list[np.ndarray]]]]:
        """The log half of `append_many`: the seqs, and the new rows by scope tag, to publish.
        `meta` (keys under `meta:`) is written in the same transaction as the rows: a reader of
        a shared stream records how far it has read together with what it read."""
        seqs: list[int] = []
        fresh: dict[str, tuple[list[int], list[np.ndarray]]] = {}
        with self._env.begin(write=True) as txn:
            for key, value in (meta or {}).items():
                if not key.startswith(_META_PREFIX):
                    raise ValueError(f"a log meta key must start with {_META_PREFIX!r}: {key!r}")
                txn.put(key, value)
            raw = txn.get(_NEXT_KEY)
            seq = int.from_bytes(raw, "big") if raw else 0
            for scope, digest, prompt, vector in rows:
                vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
                tag = _tag_bytes(scope)
                digest_key = _DIGEST + tag + digest.encode("utf-8")
                known = txn.get(digest_key)
                if known is not None and txn.get(_ROW_PREFIX + known) is not None:
                    seqs.append(int.from_bytes(known, "big"))
                    continue
                manifest = self._manifest(txn, tag)
                if manifest is None:
                    manifest = TableManifest(scope, 0, len(vector), INITIAL_CAPACITY)
                    txn.put(_MANIFEST + tag, _encode_manifest(manifest))
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
        """Forget an empty scope's table (its manifest), in the transaction that sees it empty:
        a row appended after it starts the scope again with a new table."""
        key = bytes.fromhex(tag)
        with self._env.begin(write=True) as txn:
            raw = txn.get(_LIVE + key)
            if raw and int.from_bytes(raw, "big"):
                return False
            return bool(txn.delete(_MANIFEST + key))

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
        self.wait_compacted()
        self._env.close()


def _encode_manifest(manifest: TableManifest) -> bytes:
    head = _MANIFEST_HEAD.pack(manifest.epoch, manifest.width, manifest.capacity)
    return head + manifest.scope.encode("utf-8")


# HNSW parameters. They are hashed into every saved graph's prefix digest, so a graph built with
# other parameters is never loaded; bump the format tag when the file layout changes.
_HNSW_M = 12
_HNSW_EF_CONSTRUCTION = 40
_HNSW_EF_SEARCH = 128
_GRAPH_FORMAT = f"tiercache-hnsw-v1 ip M={_HNSW_M} ef_construction={_HNSW_EF_CONSTRUCTION}"
_ROW_ID = struct.Struct(">Q16s")  # a row's identity in a graph's prefix: seq, row checksum
_GRAPH_NAME = re.compile(r"^([0-9a-f]{24})\.(\d+)\.([0-9a-f]{32})\.([0-9a-f]{32})\.hnsw$")
_ABANDONED_TMP_S = 3600.0  # a temporary file this old is left over from a crashed save
_RESAVE_FRACTION = 0.1  # after a load, re-save when the rows added on top reach this share


def _since(started: float) -> float:
    return time.perf_counter() - started


class GraphFileError(Exception):
    """A saved graph that must not be used (its bytes or contents do not match its name)."""


def scope_tag(scope: str) -> str:
    """The part of a graph file's name that says which scope it belongs to."""
    return hashlib.sha256(scope.encode("utf-8")).hexdigest()[:24]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class GraphFile:
    """A saved graph: `<scope tag>.<rows>.<prefix digest>.<content digest>.hnsw`."""

    path: Path
    scope_tag: str
    rows: int  # it holds the scope's first `rows` rows, labelled 0 .. rows - 1
    prefix: str  # digest of those rows' identities (see `_Scope.prefix_digest`)
    content: str  # digest of the file's bytes


class GraphFiles:
    """Saved HNSW graphs of large scopes, in a folder beside the row log.

    A file's name ties it to its scope and to the exact rows it covers (the digest of those
    rows' sequence numbers and checksums, in index order, and of the graph parameters), and to
    its own bytes. A start uses a file only when both match; anything else is rebuilt. Writers
    save under a private temporary name and rename, so no reader sees a partial file and
    processes saving at once cannot damage each other's files. No fsync: a file torn by a crash
    fails its content check and is rebuilt.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock

    def candidates(self, scope: str) -> list[GraphFile]:
        """The scope's saved graphs, the one covering most rows first."""
        tag = scope_tag(scope)
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _GRAPH_NAME.match(name)
            if match and match.group(1) == tag:
                rows, prefix, content = int(match.group(2)), match.group(3), match.group(4)
                found.append(GraphFile(self.path / name, tag, rows, prefix, content))
        return sorted(found, key=lambda f: f.rows, reverse=True)

    def load(self, file: GraphFile, dimensions: int, max_elements: int) -> Any:
        """The graph in `file`, room for `max_elements`; GraphFileError if it must not be used,
        OSError if it went away (another process replaced or deleted it)."""
        if file_digest(file.path) != file.content:
            raise GraphFileError("its bytes do not match the digest in its name")
        import hnswlib

        index = hnswlib.Index(space="ip", dim=dimensions)
        try:
            index.load_index(str(file.path), max_elements=max(max_elements, file.rows))
        except RuntimeError as exc:  # hnswlib's "Index seems to be corrupted or unsupported"
            raise GraphFileError(f"hnswlib: {exc}") from exc
        if index.get_current_count() != file.rows:
            raise GraphFileError(f"it holds {index.get_current_count()} rows, not {file.rows}")
        index.set_ef(_HNSW_EF_SEARCH)
        return index

    def save(self, scope: str, rows: int, prefix: str, index: Any) -> GraphFile | None:
        """Save `index`, which covers the scope's first `rows` rows (digest `prefix`), then
        delete the scope's files that cover fewer rows. None when another process already saved
        a graph of the same rows. Raises OSError or RuntimeError (hnswlib) when it cannot write."""
        tag = scope_tag(scope)
        existing = self.candidates(scope)
        if any(f.rows == rows and f.prefix == prefix for f in existing):
            return None
        self.path.mkdir(parents=True, exist_ok=True)
        self._remove_abandoned(tag)
        tmp = self.path / f".{tag}.{uuid.uuid4().hex}.tmp"
        try:
            index.save_index(str(tmp))
            content = file_digest(tmp)
            path = self.path / f"{tag}.{rows}.{prefix}.{content}.hnsw"
            os.replace(tmp, path)  # atomic: readers see the old name set or the whole new file
        finally:
            tmp.unlink(missing_ok=True)
        for f in existing:
            if f.rows < rows:
                self.discard(f)
        return GraphFile(path, tag, rows, prefix, content)

    def discard(self, file: GraphFile) -> None:
        file.path.unlink(missing_ok=True)

    def _remove_abandoned(self, tag: str) -> None:
        for tmp in self.path.glob(f".{tag}.*.tmp"):
            try:
                if self._clock() - tmp.stat().st_mtime > _ABANDONED_TMP_S:
                    tmp.unlink()
            except FileNotFoundError:
                pass


_GRAPH_TAIL_ROWS = 256  # rows past a graph's end are scanned flat until this many, then added


@dataclass(slots=True)
class _Scope:
    """One scope as this process reads it: the host's shared table of its vectors (zero copy),
    plus, once it is large, this process's HNSW graph of the table's first `graph_rows` rows,
    labelled by table index. Rows after those are scanned flat."""

    name: str
    dimensions: int
    log_id: bytes
    table: native.SharedTable
    hnsw: object | None = None
    graph_rows: int = 0  # table rows in the graph
    graph_prefix: str = ""  # prefix_digest(graph_rows) when the graph was built or loaded
    saved_rows: int = 0  # rows in the graph file this process last loaded or saved
    # Log seqs of rows whose answer was invalidated (tiercache.invalidation): they stay in the
    # table and graph, and a search never returns them (SemanticIndex.forget).
    dead: set[int] = field(default_factory=set)

    @property
    def count(self) -> int:
        return self.table.count()

    def prefix_digest(self, rows: int) -> str:
        """Identity of the table's first `rows` rows (their log seqs, in table order, of this
        row log): a saved graph of them is valid for this scope."""
        h = hashlib.sha256(f"{_GRAPH_FORMAT} dim={self.dimensions}\0{self.name}\0".encode())
        h.update(self.log_id)
        h.update(np.asarray(self.table.ids(rows)).tobytes())
        return h.hexdigest()[:32]

    def build_hnsw(self, rows: np.ndarray) -> None:
        import hnswlib  # only large scopes need it

        index = hnswlib.Index(space="ip", dim=self.dimensions)
        count = len(rows)
        index.init_index(max_elements=2 * count, ef_construction=_HNSW_EF_CONSTRUCTION, M=_HNSW_M)
        index.set_ef(_HNSW_EF_SEARCH)
        index.add_items(rows, np.arange(count))
        self.hnsw, self.graph_rows, self.graph_prefix = index, count, self.prefix_digest(count)

    def hnsw_add(self, rows: np.ndarray) -> None:
        """Add the snapshot's rows past the graph's end."""
        index: Any = self.hnsw
        stop = len(rows)
        if stop <= self.graph_rows:
            return
        if stop > index.get_max_elements():
            index.resize_index(2 * stop)
        index.add_items(rows[self.graph_rows : stop], np.arange(self.graph_rows, stop))
        self.graph_rows, self.graph_prefix = stop, self.prefix_digest(stop)

    @staticmethod
    def holds_own_vectors(index: Any, rows: np.ndarray, count: int) -> bool:
        """Spot check of a loaded graph: a few of its stored vectors equal the table's rows."""
        labels = sorted({0, count // 3, (2 * count) // 3, count - 1})
        stored = np.asarray(index.get_items(labels), dtype=np.float32)
        return bool(np.array_equal(stored, rows[labels]))

    def search(self, rows: np.ndarray, query: np.ndarray, k: int) -> list[tuple[float, int]]:
        """(similarity, table index) of the nearest rows of the snapshot `rows`, best first."""
        count = len(rows)
        if count == 0:
            return []
        k = min(k, count)
        if self.hnsw is None or not self.graph_rows:  # the flat scan alone
            scores = rows @ query
            top = np.argpartition(-scores, k - 1)[:k] if k < count else np.arange(count)
            top = top[np.argsort(-scores[top], kind="stable")]
            return [(float(scores[i]), int(i)) for i in top]
        index: Any = self.hnsw
        labels, _ = index.knn_query(query, k=min(k, self.graph_rows))
        candidates = labels[0].astype(np.int64)
        if self.graph_rows < count:  # the rows past the graph's end, scanned flat
            scores = rows[self.graph_rows :] @ query
            kk = min(k, len(scores))
            part = np.argpartition(-scores, kk - 1)[:kk] if kk < len(scores) else np.arange(kk)
            candidates = np.concatenate([candidates, part.astype(np.int64) + self.graph_rows])
        # The graph only nominates rows; their similarity comes from the table's rows, so a
        # graph can cost recall but never report a wrong similarity.
        scores = rows[candidates] @ query
        order = np.argsort(-scores, kind="stable")[:k]
        return [(float(scores[j]), int(candidates[j])) for j in order]


@dataclass(frozen=True, slots=True)
class _RowMeta:
    scope: str
    digest: str
    prompt: str


_META_CACHE_ROWS = 1 << 16  # metadata of the candidates a process served lately
_DEAD_OVERFETCH = 64  # extra candidates a search fetches to make up for hidden rows


@dataclass(frozen=True, slots=True)
class IndexStats:
    rows: int
    scopes: int
    graphs_built: int  # HNSW graphs built from rows
    graphs_loaded: int  # HNSW graphs loaded from a saved file
    graphs_saved: int  # graph files written by this process
    graph_files_rejected: int  # saved files not used: other rows, damaged, unreadable
    tables_reopened: int = 0  # scope tables found retired (compacted, grown) and reopened


class SemanticIndex:
    """Search of the host's semantic rows: each scope's vectors come from its shared table
    (`SemanticStore.tables`), a zero-copy snapshot per search; the digest and prompt of the
    top k from the row log, by seq. A table found retired (compaction, growth) is reopened.

    Graph files (`persist_graphs`, under `<row log>/graphs`) are saved after a build, after a
    load that had to add many rows on top (a restart after a crash), and at `close`; searches
    never write one, except the save right after a scope first grows past `flat_max_rows`, which
    costs less than that build.
    """

    def __init__(
        self,
        store: SemanticStore,
        dimensions: int,
        flat_max_rows: int = 10_000,
        persist_graphs: bool = True,
    ) -> None:
        self.store = store
        self.dimensions = dimensions
        self.flat_max_rows = flat_max_rows
        self.graphs = GraphFiles(store.path / "graphs") if persist_graphs else None
        self._scopes: dict[str, _Scope] = {}
        self._visible = 0  # rows seen by the last refresh
        self._meta: dict[int, _RowMeta] = {}  # by log seq, see _metadata
        self._lock = threading.Lock()
        self._built = self._loaded = self._saved = self._rejected = self._reopened = 0
        self._builders: dict[str, threading.Thread] = {}  # scopes whose graph is being built
        self._build_failed: dict[str, float] = {}  # scope -> when its last build failed

    def refresh(self) -> int:
        """Open every scope's table of the host (a start: large scopes get their graph here,
        holding every row); the number of rows that became visible since the last refresh."""
        with self._lock:
            for _, manifest in self.store.manifests():
                if manifest.width == self.dimensions:
                    scope = self._open(manifest.scope, background=False)
                    if scope is not None and scope.hnsw is not None:
                        scope.hnsw_add(scope.table.snapshot())
            visible = sum(s.count for s in self._scopes.values())
            fresh, self._visible = max(0, visible - self._visible), visible
            return fresh

    def _open(self, name: str, background: bool = True) -> _Scope | None:
        """The scope, its table reopened if it was retired; None when it has no rows. Call
        with the lock held. A graph the scope needs (it crossed `flat_max_rows`, or compaction
        rewrote its rows) is built on a background thread (`background`; searches scan flat
        meanwhile), or here (a start: `refresh`)."""
        scope = self._scopes.get(name)
        if scope is not None and not scope.table.retired():
            self._grow_graph(scope, background)
            return scope
        table = self.store.tables.open_current(scope_tag(name), self.dimensions)
        if table is None:
            gone = self._scopes.pop(name, None)
            if gone is not None:  # dropped (no rows left): unmap its deleted file now
                gone.table.close()
            return None
        if scope is None:
            scope = self._scopes[name] = _Scope(name, self.dimensions, self.store.log_id, table)
        else:
            old, scope.table = scope.table, table
            old.close()
            self._reopened += 1
            if scope.dead:  # compaction drops hidden rows whose answers are gone: forget them
                scope.dead &= set(np.asarray(table.ids(table.count())).tolist())
            if scope.hnsw is not None and (
                table.count() < scope.graph_rows
                or scope.prefix_digest(scope.graph_rows) != scope.graph_prefix
            ):  # the rows were rewritten (compaction): the graph's labels no longer hold
                scope.hnsw, scope.graph_rows, scope.graph_prefix = None, 0, ""
        self._grow_graph(scope, background)
        return scope

    def _grow_graph(self, scope: _Scope, background: bool = False) -> None:
        if scope.hnsw is None:
            if scope.count > self.flat_max_rows:
                if background:
                    self._attach_later(scope.name)
                else:
                    self._attach_graph(scope)
        elif scope.count - scope.graph_rows >= _GRAPH_TAIL_ROWS:
            scope.hnsw_add(scope.table.snapshot())

    def _attach_later(self, name: str) -> None:
        """Start building (or loading) `name`'s graph on a thread of its own, unless one is
        already at it. Call with the lock held."""
        if name in self._builders:
            return
        failed_s = self._build_failed.get(name)
        if failed_s is not None and time.monotonic() - failed_s < _BUILD_RETRY_S:
            return  # failed lately: scan flat, try again later
        builder = threading.Thread(
            target=self._build_detached, args=(name,), name="semantic-graph", daemon=True
        )
        self._builders[name] = builder
        builder.start()

    def _build_detached(self, name: str) -> None:
        """Load or build a graph on this thread's own handle of the scope's table, then give it
        to the scope if its rows are still the ones it covers (same log seqs, same order)."""
        try:
            table = self.store.tables.open_current(scope_tag(name), self.dimensions)
            if table is None:
                return
            shadow = _Scope(name, self.dimensions, self.store.log_id, table)
            try:
                self._attach_graph(shadow)
                with self._lock:
                    scope = self._scopes.get(name)
                    if (
                        scope is not None
                        and scope.hnsw is None
                        and not scope.table.retired()
                        and scope.count >= shadow.graph_rows
                        and scope.prefix_digest(shadow.graph_rows) == shadow.graph_prefix
                    ):
                        scope.hnsw, scope.graph_rows = shadow.hnsw, shadow.graph_rows
                        scope.graph_prefix, scope.saved_rows = (
                            shadow.graph_prefix,
                            shadow.saved_rows,
                        )
            finally:
                table.close()
        except Exception:  # noqa: BLE001 - searches go on scanning flat; retried later
            log.exception("building the graph of a scope failed; retried in %.0f s", _BUILD_RETRY_S)
            with self._lock:
                self._build_failed[name] = time.monotonic()
        finally:
            with self._lock:
                self._builders.pop(name, None)

    def wait_graphs(self, timeout_s: float = 120.0) -> bool:
        """Wait for the graphs being built in the background; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                builders = list(self._builders.values())
            if not builders:
                return True
            for builder in builders:
                builder.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._builders

    def _attach_graph(self, scope: _Scope) -> None:
        """Give a scope that outgrew the flat scan its graph: the newest saved one that matches
        its rows plus the rows after it, else a new build."""
        started = time.perf_counter()
        rows = scope.table.snapshot()
        covered = self._load_graph(scope, rows)
        if covered is None:
            scope.build_hnsw(rows)
            self._built += 1
            log.info("built a graph of %d rows in %.1f s", len(rows), _since(started))
            self._save_graph(scope)
            return
        self._loaded += 1
        scope.hnsw_add(rows)
        log.info(
            "loaded a saved graph of %d rows and added %d in %.1f s",
            covered,
            len(rows) - covered,
            _since(started),
        )
        if len(rows) - covered >= _RESAVE_FRACTION * covered:
            self._save_graph(scope)

    def _load_graph(self, scope: _Scope, rows: np.ndarray) -> int | None:
        """Attach the newest usable saved graph; the number of rows it covers, or None."""
        if self.graphs is None:
            return None
        for file in self.graphs.candidates(scope.name):
            if file.rows > len(rows):
                continue  # saved by a process that has seen more rows than this one
            prefix = scope.prefix_digest(file.rows)
            if prefix != file.prefix:
                # It covers other rows than the table holds in that order (compacted or
                # rebuilt since, or another log's), so it can never match again.
                log.info("graph %s covers other rows than the table; deleted", file.path.name)
                self._reject(file)
                continue
            try:
                index = self.graphs.load(file, self.dimensions, 2 * len(rows))
                if not scope.holds_own_vectors(index, rows, file.rows):
                    raise GraphFileError("its vectors differ from the table's rows")
            except GraphFileError as exc:
                log.warning("graph %s is unusable (%s); deleted", file.path.name, exc)
                self._reject(file)
                continue
            except OSError as exc:  # replaced or deleted by another process meanwhile
                log.info("graph %s could not be read (%s)", file.path.name, exc)
                self._rejected += 1
                continue
            scope.hnsw, scope.graph_rows, scope.graph_prefix = index, file.rows, prefix
            scope.saved_rows = file.rows
            return file.rows
        return None

    def _reject(self, file: GraphFile) -> None:
        self._rejected += 1
        if self.graphs is not None:
            self.graphs.discard(file)

    def _save_graph(self, scope: _Scope) -> None:
        """Best effort: a graph that cannot be saved is rebuilt at the next start."""
        if self.graphs is None or scope.hnsw is None:
            return
        try:
            saved = self.graphs.save(scope.name, scope.graph_rows, scope.graph_prefix, scope.hnsw)
        except (OSError, RuntimeError) as exc:
            log.warning("could not save a scope's graph (%d rows): %s", scope.graph_rows, exc)
            return
        scope.saved_rows = scope.graph_rows
        self._saved += saved is not None

    def save_graphs(self) -> None:
        """Add the rows past each graph's end to it, and save every graph that has grown since
        its file was written."""
        with self._lock:
            for scope in self._scopes.values():
                if scope.hnsw is not None and not scope.table.retired():
                    scope.hnsw_add(scope.table.snapshot())
                    if scope.graph_rows > scope.saved_rows:
                        self._save_graph(scope)

    def search(self, scope: str, query: np.ndarray, k: int = 5) -> list[Neighbour]:
        """Nearest rows of `scope` only, best first. Best effort: a row deleted from the log
        since the snapshot (compaction) or damaged there is left out, so fewer than k may
        come back."""
        with self._lock:
            rows = self._open(scope)
            if rows is None:
                return []
            snapshot = rows.table.snapshot()
            # Hidden rows are skipped by fetching a few more, bounded: a tag or tenant that hid
            # thousands of rows must not make every search fetch thousands (recall may drop
            # where hidden rows crowd the top; a hidden row is never returned).
            nearest = rows.search(snapshot, query, k + min(len(rows.dead), _DEAD_OVERFETCH))
            ids = rows.table.ids(len(snapshot))
            if rows.dead:
                nearest = [(sim, i) for sim, i in nearest if int(ids[i]) not in rows.dead][:k]
        found = self._metadata([int(ids[i]) for _, i in nearest])
        return [
            Neighbour(similarity, row.digest, row.prompt)
            for (similarity, _), row in zip(nearest, found, strict=True)
            if row is not None and row.scope == scope
        ]

    def _metadata(self, seqs: list[int]) -> list[_RowMeta | None]:
        """The rows' scope, digest and prompt: from this process's cache, else the log (a row
        never changes under its seq; one deleted since is at worst a stale candidate, whose
        answer is gone too). The cache is bounded: it is cleared when full."""
        cache = self._meta
        wanted = [seq for seq in seqs if seq not in cache]
        if wanted:
            if len(cache) + len(wanted) > _META_CACHE_ROWS:
                cache.clear()
            for seq, row in zip(wanted, self.store.rows(wanted), strict=True):
                if row is not None:
                    cache[seq] = _RowMeta(row.scope, row.digest, row.prompt)
        return [cache.get(seq) for seq in seqs]

    def add(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> int:
        return self.store.append(scope, digest, prompt, vector)

    def forget(self, digests: list[str]) -> int:
        """Stop returning the rows of these answers' digests (their answers were invalidated);
        how many rows this process stopped returning. Every process that hears of the
        invalidation calls this: the first one moves each digest's row from the scope's
        digest key to its forgotten list in the log (so the answer, generated again, is indexed
        as a new row), and every process hides the rows on that list. Hidden until the process
        restarts; after that such a row is a `stale` miss (its answer is gone), never a wrong
        answer. A process that handles the message only after the answer was generated and
        indexed again also hides the new row (recall, not correctness)."""
        wanted = sorted(set(digests))
        if not wanted:
            return 0
        with self._lock:
            forgotten = 0
            for name, scope in self._scopes.items():
                seqs = set(self.store.forget_digests(scope_tag(name), wanted)) - scope.dead
                if seqs:
                    scope.dead |= seqs
                    forgotten += len(seqs)
            return forgotten

    def size(self, scope: str | None = None) -> int:
        """Rows in `scope`'s table, or in every table this process has opened."""
        with self._lock:
            if scope is not None:
                rows = self._open(scope)
                return 0 if rows is None else rows.count - len(rows.dead)
            return sum(s.count - len(s.dead) for s in self._scopes.values())

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                sum(s.count - len(s.dead) for s in self._scopes.values()),
                len(self._scopes),
                self._built,
                self._loaded,
                self._saved,
                self._rejected,
                self._reopened,
            )

    def close(self) -> None:
        self.wait_graphs()
        self.save_graphs()
        with self._lock:
            for scope in self._scopes.values():
                scope.table.close()
            self._scopes.clear()
        self.store.close()
