"""One scope's search in this process: a flat scan of the scope's shared table, and an HNSW
graph (hnswlib) of its first rows once the scope is large.

Inside a scope the search is a flat matrix-vector product up to `flat_max_rows` rows
(`SemanticIndex`), and an HNSW graph beyond, per process, fed from the table (rows not yet in it
are scanned flat). The graph only nominates rows; similarities always come from the table.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tiercache_native as native

from tiercache.log_throttle import LogThrottle
from tiercache.semantic.graph_files import (
    GRAPH_FORMAT,
    HNSW_EF_CONSTRUCTION,
    HNSW_EF_SEARCH,
    HNSW_M,
)
from tiercache.semantic.row_log import NORM_TOLERANCE

log = logging.getLogger(__name__)
_DAMAGE_LOG = LogThrottle()

GRAPH_FIXED_BYTES = 5 << 19  # a graph's own fixed cost (hnswlib 0.8: its label locks, ~2.5 MiB)
GRAPH_SLOT_BYTES = 48  # per element of capacity, used or not (hnswlib's per-slot arrays)


def graph_bytes_for(rows: int, capacity: int, dimensions: int) -> int:
    """What an hnswlib graph of `rows` elements with room for `capacity` holds in memory: each
    element stored (its vector, level-0 links, label, count; upper levels and allocator
    overhead about 15 % more), a few bytes per slot of capacity, and a fixed part. hnswlib
    allocates the whole capacity, but pages of it no element touched are not resident."""
    element = int((dimensions * 4 + 2 * HNSW_M * 4 + 4 + 8) * 1.15)
    return rows * element + capacity * GRAPH_SLOT_BYTES + GRAPH_FIXED_BYTES


@dataclass(slots=True)
class ScopeSearch:
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
    # Log seqs of rows whose answer was invalidated (tiercache.exact.invalidation): they stay in the
    # table and graph, and a search never returns them (SemanticIndex.forget).
    dead: set[int] = field(default_factory=set)
    last_search_s: float = 0.0  # monotonic time of its last search (the graph budget's order)
    graph_search_s: float = 0.0  # recent seconds per search with its graph (moving average)
    damaged: int = 0  # candidates left out: their table row was no finite unit vector (`_sound`)

    def graph_bytes(self) -> int:
        """What its graph holds in this process's memory (`graph_bytes_for`); 0 without one."""
        index: Any = self.hnsw
        if index is None:
            return 0
        count, capacity = int(index.get_current_count()), int(index.get_max_elements())
        return graph_bytes_for(count, capacity, self.dimensions)

    @property
    def count(self) -> int:
        return self.table.count()

    def prefix_digest(self, rows: int) -> str:
        """Identity of the table's first `rows` rows (their log seqs, in table order, of this
        row log): a saved graph of them is valid for this scope."""
        h = hashlib.sha256(f"{GRAPH_FORMAT} dim={self.dimensions}\0{self.name}\0".encode())
        h.update(self.log_id)
        h.update(np.asarray(self.table.ids(rows)).tobytes())
        return h.hexdigest()[:32]

    def build_hnsw(self, rows: np.ndarray) -> None:
        import hnswlib  # only large scopes need it

        index = hnswlib.Index(space="ip", dim=self.dimensions)
        count = len(rows)
        index.init_index(max_elements=2 * count, ef_construction=HNSW_EF_CONSTRUCTION, M=HNSW_M)
        index.set_ef(HNSW_EF_SEARCH)
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
        try:
            stored = np.asarray(index.get_items(labels), dtype=np.float32)
        except RuntimeError:  # hnswlib: "Label not found": not this table's graph
            return False
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
            return self._sound(rows, [(float(scores[i]), int(i)) for i in top])
        index: Any = self.hnsw
        labels, _ = index.knn_query(query, k=min(k, self.graph_rows))
        candidates = labels[0].astype(np.int64)
        candidates = candidates[(candidates >= 0) & (candidates < count)]  # never past the rows
        if self.graph_rows < count:  # the rows past the graph's end, scanned flat
            scores = rows[self.graph_rows :] @ query
            kk = min(k, len(scores))
            part = np.argpartition(-scores, kk - 1)[:kk] if kk < len(scores) else np.arange(kk)
            candidates = np.concatenate([candidates, part.astype(np.int64) + self.graph_rows])
        # The graph only nominates rows; their similarity comes from the table's rows, so a
        # graph can cost recall but never report a wrong similarity.
        scores = rows[candidates] @ query
        order = np.argsort(-scores, kind="stable")[:k]
        return self._sound(rows, [(float(scores[j]), int(candidates[j])) for j in order])

    def _sound(self, rows: np.ndarray, found: list[tuple[float, int]]) -> list[tuple[float, int]]:
        """`found` less the candidates whose table row is no longer what was written (a finite
        unit vector, as the log's checksummed copy is): one value of a row changed on disk
        would give that row any similarity, and its answer to every query of the scope. Left
        out, counted in `damaged` and logged (the scope's table is rebuilt from the log when
        its file is replaced): a miss, never a wrong hit."""
        if not found:
            return found
        picked = rows[np.fromiter((i for _, i in found), dtype=np.int64, count=len(found))]
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.linalg.norm(picked.astype(np.float64), axis=1)
        sound = np.abs(norms - 1.0) <= NORM_TOLERANCE  # NaN: False
        if bool(sound.all()):
            return found
        kept = [pair for pair, ok in zip(found, sound, strict=True) if ok]
        self.damaged += len(found) - len(kept)
        if _DAMAGE_LOG.ready():
            log.error(
                "scope %s...: %d of its table rows found damaged (not a finite unit vector) and "
                "left out of a search (%d such lines not logged): stop the server and remove "
                "the scope's table file so that it is rebuilt from the row log",
                self.name[:12],
                len(found) - len(kept),
                _DAMAGE_LOG.suppressed,
            )
        return kept
