"""The semantic index: prompt vectors of cached answers, searched only inside their scope.

Rows live in an append-only LMDB log on the host (`SemanticStore`), so every process sees every
other process's writes and the index survives restarts. Each process mirrors the log in memory
(`SemanticIndex`), catching up on new rows before each search with one read of the log's head.
Inside a scope the search is a flat matrix-vector product up to `flat_max_rows` rows, and an
HNSW graph (hnswlib) beyond, where the flat scan stops being fast enough (see README).

Building a large scope's graph dominates a start (about 12 s for 100,000 rows on 2 cores), so
graphs are saved next to the row log (`GraphFiles`) and a start loads the newest one that covers
a prefix of the scope's rows, then adds only the rows appended after it.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

log = logging.getLogger(__name__)

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


class SemanticStore:
    """Append-only row log in LMDB; LMDB serializes writers across processes."""

    def __init__(
        self, path: Path, max_bytes: int = 2 << 30, clock: Callable[[], float] = time.time
    ) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
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


@dataclass(slots=True)
class _Scope:
    """One scope's rows in memory: a growing matrix, plus an HNSW graph once it is large."""

    name: str
    dimensions: int
    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    count: int = 0
    digests: list[str] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    known: set[str] = field(default_factory=set)
    row_ids: bytearray = field(default_factory=bytearray)  # _ROW_ID per row, in matrix order
    hnsw: object | None = None
    graph_rows: int = 0  # rows in the graph file this process last loaded or saved
    # Rows whose answer was invalidated (tiercache.invalidation): kept in the matrix and graph
    # (their positions and saved graphs stay valid), never returned by a search.
    dead: set[int] = field(default_factory=set)

    @property
    def live(self) -> int:
        return self.count - len(self.dead)

    def forget(self, digests: set[str]) -> int:
        """Mark the rows of `digests` dead; a later row with one of them is indexed afresh.
        O(rows of the scope)."""
        if not digests & self.known:
            return 0
        forgotten = 0
        for i, digest in enumerate(self.digests):
            if digest in digests and i not in self.dead:
                self.dead.add(i)
                forgotten += 1
        self.known -= digests
        return forgotten

    def extend(self, rows: list[IndexRow]) -> None:
        """Add rows (a digest already present is skipped); a graph takes them in one batch."""
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
            self.row_ids += _ROW_ID.pack(row.seq, row.checksum)
        if self.hnsw is not None:
            self.hnsw_add(start, self.count)

    def prefix_digest(self, rows: int) -> str:
        """Identity of the first `rows` rows: a saved graph of them is valid for this scope."""
        h = hashlib.sha256(f"{_GRAPH_FORMAT} dim={self.dimensions}\0{self.name}\0".encode())
        h.update(memoryview(self.row_ids)[: rows * _ROW_ID.size])
        return h.hexdigest()[:32]

    def build_hnsw(self) -> None:
        import hnswlib  # only large scopes need it

        index = hnswlib.Index(space="ip", dim=self.dimensions)
        index.init_index(
            max_elements=2 * self.count, ef_construction=_HNSW_EF_CONSTRUCTION, M=_HNSW_M
        )
        index.set_ef(_HNSW_EF_SEARCH)
        index.add_items(self.vectors[: self.count], np.arange(self.count))
        self.hnsw = index

    def hnsw_add(self, start: int, stop: int) -> None:
        index: Any = self.hnsw
        if stop > index.get_max_elements():
            index.resize_index(2 * stop)
        index.add_items(self.vectors[start:stop], np.arange(start, stop))

    def holds_own_vectors(self, index: Any, rows: int) -> bool:
        """Spot check of a loaded graph: a few of its stored vectors equal this scope's rows."""
        labels = sorted({0, rows // 3, (2 * rows) // 3, rows - 1})
        stored = np.asarray(index.get_items(labels), dtype=np.float32)
        return bool(np.array_equal(stored, self.vectors[labels]))

    def search(self, query: np.ndarray, k: int) -> list[tuple[float, int]]:
        if self.live == 0:
            return []
        k = min(k, self.live)
        if self.hnsw is not None:
            index: Any = self.hnsw
            labels, _ = index.knn_query(query, k=min(self.count, k + len(self.dead)))
            ids = np.array([i for i in labels[0].astype(np.int64) if i not in self.dead][:k])
            if ids.size == 0:
                return []
            # The graph only nominates rows; their similarity comes from this process's own
            # matrix, so a graph can cost recall but never report a wrong similarity.
            scores = self.vectors[ids] @ query
            order = np.argsort(-scores, kind="stable")
            return [(float(scores[j]), int(ids[j])) for j in order]
        scores = self.vectors[: self.count] @ query
        if self.dead:
            scores[list(self.dead)] = -np.inf
        if k == self.count:
            top = np.argsort(-scores)
        else:
            part = np.argpartition(-scores, k - 1)[:k]
            top = part[np.argsort(-scores[part])]
        return [(float(scores[i]), int(i)) for i in top]


@dataclass(frozen=True, slots=True)
class IndexStats:
    rows: int
    scopes: int
    graphs_built: int  # HNSW graphs built from rows
    graphs_loaded: int  # HNSW graphs loaded from a saved file
    graphs_saved: int  # graph files written by this process
    graph_files_rejected: int  # saved files not used: other rows, damaged, unreadable


class SemanticIndex:
    """This process's view of the host's semantic rows, kept in step with the store.

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
        self._seen = 0
        self._lock = threading.Lock()
        self._built = self._loaded = self._saved = self._rejected = 0

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
                    scope = self._scopes[name] = _Scope(name, self.dimensions)
                scope.extend(rows)
                if scope.hnsw is None and scope.count > self.flat_max_rows:
                    self._attach_graph(scope)
            self._seen = head
            return sum(len(rows) for rows in by_scope.values())

    def _attach_graph(self, scope: _Scope) -> None:
        """Give a scope that outgrew the flat scan its graph: the newest saved one that matches
        its rows plus the rows after it, else a new build."""
        started = time.perf_counter()
        covered = self._load_graph(scope)
        if covered is None:
            scope.build_hnsw()
            self._built += 1
            log.info("built a graph of %d rows in %.1f s", scope.count, _since(started))
            self._save_graph(scope)
            return
        self._loaded += 1
        if scope.count > covered:
            scope.hnsw_add(covered, scope.count)
        log.info(
            "loaded a saved graph of %d rows and added %d in %.1f s",
            covered,
            scope.count - covered,
            _since(started),
        )
        if scope.count - covered >= _RESAVE_FRACTION * covered:
            self._save_graph(scope)

    def _load_graph(self, scope: _Scope) -> int | None:
        """Attach the newest usable saved graph; the number of rows it covers, or None."""
        if self.graphs is None:
            return None
        for file in self.graphs.candidates(scope.name):
            if file.rows > scope.count:
                continue  # saved by a process that has seen more rows than this one
            if scope.prefix_digest(file.rows) != file.prefix:
                # It covers rows the log no longer holds in that order (compacted or rewritten
                # since), so it can never match again.
                log.info("graph %s covers other rows than the log; deleted", file.path.name)
                self._reject(file)
                continue
            try:
                index = self.graphs.load(file, self.dimensions, 2 * scope.count)
                if not scope.holds_own_vectors(index, file.rows):
                    raise GraphFileError("its vectors differ from the log's rows")
            except GraphFileError as exc:
                log.warning("graph %s is unusable (%s); deleted", file.path.name, exc)
                self._reject(file)
                continue
            except OSError as exc:  # replaced or deleted by another process meanwhile
                log.info("graph %s could not be read (%s)", file.path.name, exc)
                self._rejected += 1
                continue
            scope.hnsw, scope.graph_rows = index, file.rows
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
            saved = self.graphs.save(
                scope.name, scope.count, scope.prefix_digest(scope.count), scope.hnsw
            )
        except (OSError, RuntimeError) as exc:
            log.warning("could not save a scope's graph (%d rows): %s", scope.count, exc)
            return
        scope.graph_rows = scope.count
        self._saved += saved is not None

    def save_graphs(self) -> None:
        """Save every graph that has grown since its file was written."""
        with self._lock:
            for scope in self._scopes.values():
                if scope.hnsw is not None and scope.count > scope.graph_rows:
                    self._save_graph(scope)

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

    def forget(self, digests: list[str]) -> int:
        """Stop returning the rows of these answers' digests (their answers were invalidated);
        how many rows. In this process only and until it restarts: the host's row log keeps
        them, and a row whose answer is gone is a miss (`stale`), never a wrong answer."""
        wanted = set(digests)
        if not wanted:
            return 0
        with self._lock:
            return sum(scope.forget(wanted) for scope in self._scopes.values())

    def size(self, scope: str | None = None) -> int:
        with self._lock:
            if scope is not None:
                rows = self._scopes.get(scope)
                return 0 if rows is None else rows.live
            return sum(s.live for s in self._scopes.values())

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                sum(s.live for s in self._scopes.values()),
                len(self._scopes),
                self._built,
                self._loaded,
                self._saved,
                self._rejected,
            )

    def close(self) -> None:
        self.save_graphs()
        self.store.close()
