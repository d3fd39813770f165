"""The semantic index: prompt vectors of cached answers, searched only inside their scope.

Rows live in an append-only LMDB log on the host (`SemanticStore`), so every process sees every
other process's writes and the index survives restarts. Each process mirrors the log in memory
(`SemanticIndex`), catching up on new rows before each search with one read of the log's head.
Inside a scope the search is a flat matrix-vector product up to `flat_max_rows` rows, and an
HNSW graph (hnswlib) beyond, where the flat scan stops being fast enough (see README).
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

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
        return IndexRow(seq, meta["scope"], meta["digest"], meta["prompt"], vector, created_s)
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        return None


class SemanticStore:
    """Append-only row log in LMDB; LMDB serializes writers across processes."""

    def __init__(
        self, path: Path, max_bytes: int = 2 << 30, clock: Callable[[], float] = time.time
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=max_bytes, max_readers=512)
        self._clock = clock

    def append(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> int:
        return self.append_many([(scope, digest, prompt, vector)])[0]

    def append_or_compact(
        self,
        scope: str,
        digest: str,
        prompt: str,
        vector: np.ndarray,
        answer_exists: Callable[[str], bool],
    ) -> int:
        """Append; when the log is full, drop rows whose answer is gone (else the oldest tenth)
        and try once more. Processes that mirrored a dropped row keep it until they restart;
        a hit on it finds no answer and is a miss, never a wrong answer."""
        try:
            return self.append(scope, digest, prompt, vector)
        except lmdb.MapFullError:
            self.compact(answer_exists)
            return self.append(scope, digest, prompt, vector)

    def compact(self, answer_exists: Callable[[str], bool], fallback_fraction: float = 0.1) -> int:
        """Delete rows whose answer no longer exists; if none, the oldest `fallback_fraction`."""
        dead: list[bytes] = []
        keys: list[bytes] = []
        with self._env.begin() as txn:
            for key, blob in txn.cursor():
                if not key.startswith(_ROW_PREFIX):
                    continue
                keys.append(bytes(key))
                row = decode_row(int.from_bytes(key[1:], "big"), blob)
                if row is None or not answer_exists(row.digest):
                    dead.append(bytes(key))
        if not dead:
            dead = keys[: max(1, int(len(keys) * fallback_fraction))]  # keys are in seq order
        with self._env.begin(write=True) as txn:
            return sum(bool(txn.delete(key)) for key in dead)

    def append_many(self, rows: list[tuple[str, str, str, np.ndarray]]) -> list[int]:
        """Append (scope, digest, prompt, vector) rows in one transaction (one fsync)."""
        seqs: list[int] = []
        with self._env.begin(write=True) as txn:
            raw = txn.get(_NEXT_KEY)
            seq = int.from_bytes(raw, "big") if raw else 0
            for scope, digest, prompt, vector in rows:
                row = IndexRow(seq, scope, digest, prompt, vector, self._clock())
                txn.put(_row_key(seq), encode_row(row))
                seqs.append(seq)
                seq += 1
            txn.put(_NEXT_KEY, seq.to_bytes(8, "big"))
        return seqs

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

    def close(self) -> None:
        self._env.close()


@dataclass(slots=True)
class _Scope:
    """One scope's rows in memory: a growing matrix, plus an HNSW graph once it is large."""

    dimensions: int
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    count: int = 0
    digests: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    known: set[str] = field(default_factory=set)
    hnsw: object | None = None

    def extend(self, rows: list[IndexRow], flat_max_rows: int) -> None:
        """Add rows (a digest already present is skipped); HNSW takes them in one batch."""
        fresh = [r for r in rows if r.digest not in self.known]
        if not fresh:
            return
        needed = self.count + len(fresh)
        if needed > self.vectors.shape[0]:
            grown = np.zeros((max(64, 2 * needed), self.dimensions), dtype=np.float32)
            if self.count:
                grown[: self.count] = self.vectors[: self.count]
            self.vectors = grown
        start = self.count
        for row in fresh:
            if row.digest in self.known:  # duplicates inside one batch
                continue
            self.vectors[self.count] = row.vector
            self.count += 1
            self.digests.append(row.digest)
            self.prompts.append(row.prompt)
            self.known.add(row.digest)
        if self.hnsw is not None:
            self._hnsw_add(start, self.count)
        elif self.count > flat_max_rows:
            self._build_hnsw()

    def _build_hnsw(self) -> None:
        import hnswlib  # only large scopes need it

        index = hnswlib.Index(space="ip", dim=self.dimensions)
        index.init_index(max_elements=2 * self.count, ef_construction=40, M=12)
        index.set_ef(128)
        index.add_items(self.vectors[: self.count], np.arange(self.count))
        self.hnsw = index

    def _hnsw_add(self, start: int, stop: int) -> None:
        index: Any = self.hnsw
        if stop > index.get_max_elements():
            index.resize_index(2 * stop)
        index.add_items(self.vectors[start:stop], np.arange(start, stop))

    def search(self, query: np.ndarray, k: int) -> list[tuple[float, int]]:
        if self.count == 0:
            return []
        k = min(k, self.count)
        if self.hnsw is not None:
            index: Any = self.hnsw
            labels, distances = index.knn_query(query, k=k)
            return [(1.0 - float(d), int(i)) for i, d in zip(labels[0], distances[0], strict=True)]
        scores = self.vectors[: self.count] @ query
        if k == self.count:
            top = np.argsort(-scores)
        else:
            part = np.argpartition(-scores, k - 1)[:k]
            top = part[np.argsort(-scores[part])]
        return [(float(scores[i]), int(i)) for i in top]


class SemanticIndex:
    """This process's view of the host's semantic rows, kept in step with the store."""

    def __init__(self, store: SemanticStore, dimensions: int, flat_max_rows: int = 10_000) -> None:
        self.store = store
        self.dimensions = dimensions
        self.flat_max_rows = flat_max_rows
        self._scopes: dict[str, _Scope] = {}
        self._seen = 0
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Load rows other processes (or this one) appended since the last refresh."""
        head = self.store.head()
        with self._lock:
            if head <= self._seen:
                return 0
            by_scope: dict[str, list[IndexRow]] = {}
            for row in self.store.rows_since(self._seen):
                if row.seq >= head:
                    break
                if len(row.vector) == self.dimensions:
                    by_scope.setdefault(row.scope, []).append(row)
            for name, rows in by_scope.items():
                scope = self._scopes.get(name)
                if scope is None:
                    scope = self._scopes[name] = _Scope(self.dimensions)
                scope.extend(rows, self.flat_max_rows)
            self._seen = head
            return sum(len(rows) for rows in by_scope.values())

    def search(self, scope: str, query: np.ndarray, k: int = 5) -> list[Neighbour]:
        """Nearest rows of `scope` only, best first (after catching up with the store)."""
        self.refresh()
        with self._lock:
            rows = self._scopes.get(scope)
            if rows is None:
                return []
            return [
                Neighbour(similarity, rows.digests[i], rows.prompts[i])
                for similarity, i in rows.search(query, k)
            ]

    def add(self, scope: str, digest: str, prompt: str, vector: np.ndarray) -> int:
        return self.store.append(scope, digest, prompt, vector)

    def size(self, scope: str | None = None) -> int:
        with self._lock:
            if scope is not None:
                rows = self._scopes.get(scope)
                return 0 if rows is None else rows.count
            return sum(s.count for s in self._scopes.values())

    def close(self) -> None:
        self.store.close()
