"""Embedding-cache lookup on the native shared tables against the previous implementation, side
by side in one run (issue 6, part 2).

- Lookup, vector cached: `EmbeddingCache.lookup` of a prompt whose vector is in the vector cache
  (vector-cache read + index search + choice + answer fetch) with one scope of 1k/10k/100k rows
  of 384 floats (MiniLM), flat scan (no HNSW graph, so both sides do the same arithmetic):
  `SemanticIndex` today (the scope's shared table: snapshot, scan, the top k's metadata from the
  LMDB log) against the baseline below. The guard is replaced by "take the best candidate" and
  the embedder is never called (every vector is cached): both are the same on both sides.
- Making 10,000 new rows visible to a reader: the baseline's `refresh()` (read them from the log
  into the process's matrix, in every process) against the shared table's `snapshot()` + `ids()`
  (the writer published them).
- The writer's cost for those 10,000 rows: the log append alone (what the baseline wrote) and the
  log append plus the publish to the table.

BASELINE: `_MirrorBaseline` is a small copy of the previous implementation's per-process mirror
(`SemanticIndex.refresh` + `_Scope.extend` + the flat `_Scope.search`, before the shared tables),
kept here only to measure against; it reads the same LMDB log. Prints a Markdown table.

Usage::

    python -m tiercache_dev.bench.native_index [--sizes 1000,10000,100000] [--repeats 5] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tiercache.exact.stores import MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.semantic.index import Neighbour, SemanticIndex
from tiercache.semantic.row_log import IndexRow
from tiercache.semantic.stage import EmbeddingCache
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache, vector_key
from tiercache.vocabulary import Tier
from tiercache_dev.console import invocation
from tiercache_dev.stats import median

WIDTH = 384
SCOPE = "scope"
QUERIES = 64


class _MirrorBaseline:
    """BASELINE ONLY: the previous per-process mirror of the LMDB log (refresh, then a flat scan
    of the process's own matrix), reduced to what a flat lookup runs."""

    def __init__(self, store: SemanticStore, dimensions: int) -> None:
        self.store = store
        self.dimensions = dimensions
        self._seen = 0
        self._lock = threading.Lock()
        self.vectors: dict[str, np.ndarray] = {}
        self.count: dict[str, int] = {}
        self.digests: dict[str, list[str]] = {}
        self.prompts: dict[str, list[str]] = {}
        self.known: dict[str, set[str]] = {}

    def refresh(self) -> int:
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
                self._extend(name, rows)
            self._seen = head
            return sum(len(rows) for rows in by_scope.values())

    def _extend(self, name: str, rows: list[IndexRow]) -> None:
        known = self.known.setdefault(name, set())
        fresh = [r for r in rows if r.digest not in known]
        count = self.count.get(name, 0)
        matrix = self.vectors.get(name, np.zeros((0, self.dimensions), np.float32))
        needed = count + len(fresh)
        if needed > matrix.shape[0]:
            grown = np.zeros((max(64, 2 * needed), self.dimensions), dtype=np.float32)
            grown[:count] = matrix[:count]
            matrix = self.vectors[name] = grown
        for row in fresh:
            if row.digest in known:
                continue
            matrix[count] = row.vector
            count += 1
            self.digests.setdefault(name, []).append(row.digest)
            self.prompts.setdefault(name, []).append(row.prompt)
            known.add(row.digest)
        self.count[name] = count

    def search(self, scope: str, query: np.ndarray, k: int = 5) -> list[Neighbour]:
        self.refresh()
        with self._lock:
            count = self.count.get(scope, 0)
            if count == 0:
                return []
            k = min(k, count)
            scores = self.vectors[scope][:count] @ query
            part = np.argpartition(-scores, k - 1)[:k]
            top = part[np.argsort(-scores[part])]
            return [
                Neighbour(float(scores[i]), self.digests[scope][i], self.prompts[scope][i])
                for i in top
            ]


def unit_rows(count: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((count, WIDTH)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def fill(store: SemanticStore, vectors: np.ndarray, first: int) -> None:
    for start in range(0, len(vectors), 10_000):
        chunk = vectors[start : start + 10_000]
        store.append_many(
            [
                (SCOPE, f"d{first + start + i}", f"stored prompt {first + start + i}", v)
                for i, v in enumerate(chunk)
            ]
        )


def lookup_us(stage: EmbeddingCache, prompts: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        for prompt in prompts:
            started = time.perf_counter()
            stage.lookup([prompt], [SCOPE])
            times.append(time.perf_counter() - started)
    return median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=5, help=f"x {QUERIES} lookups per size")
    parser.add_argument("--dir", default="", help="where the state goes (default: a temp dir)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="tiercache-native-index-", dir=args.dir or None))
    store = SemanticStore(root / "semantic", max_bytes=8 << 30)
    answers = TieredCache([(Tier.L1, MemoryStore(64 << 20))])
    vectors = VectorCache(root / "vectors", WIDTH)
    prompts = [f"query {i}" for i in range(QUERIES)]
    queries = unit_rows(QUERIES, 99)
    for prompt, query in zip(prompts, queries, strict=True):
        vectors.put(vector_key("bench@1", prompt), query)

    def never_embed(texts: object) -> np.ndarray:
        raise RuntimeError("every vector is cached in this benchmark")

    def stage_on(index: object) -> EmbeddingCache:
        return EmbeddingCache(
            vectors,
            index,  # type: ignore[arg-type]
            answers,
            never_embed,
            lambda q, candidates: 0 if candidates else None,
            "bench@1",
            min_similarity=-1.0,  # every lookup reaches the answer fetch
        )

    table_index = SemanticIndex(store, WIDTH, flat_max_rows=1 << 40, persist_graphs=False)
    baseline = _MirrorBaseline(store, WIDTH)
    table_stage, baseline_stage = stage_on(table_index), stage_on(baseline)
    rows_so_far = 0
    lookups: list[tuple[int, float, float]] = []
    for size in sizes:
        print(f"filling the scope to {size:,} rows", flush=True)
        fill(store, unit_rows(size - rows_so_far, size), rows_so_far)
        for i in range(rows_so_far, size, max(1, (size - rows_so_far) // 50)):
            answers.put(f"d{i}", f"answer {i}")
        rows_so_far = size
        baseline.refresh()  # caught up before timing: a lookup then only checks the log head
        table_index.search(SCOPE, queries[0])
        lookups.append(
            (
                size,
                lookup_us(baseline_stage, prompts, args.repeats),
                lookup_us(table_stage, prompts, args.repeats),
            )
        )

    print("appending 10,000 rows", flush=True)
    extra = unit_rows(10_000, 7)
    rows = [(SCOPE, f"x{i}", f"appended {i}", v) for i, v in enumerate(extra)]
    log_only = SemanticStore(root / "log-only", max_bytes=1 << 30)  # the same rows, log only
    started = time.perf_counter()
    log_only.log_rows(rows)  # all the previous implementation wrote
    log_only_s = time.perf_counter() - started
    log_only.close()
    started = time.perf_counter()
    store.append_many(rows)  # log append, then the publish to the scope's table
    log_publish_s = time.perf_counter() - started
    started = time.perf_counter()
    seen = baseline.refresh()
    refresh_s = time.perf_counter() - started
    table = table_index._scopes[SCOPE].table
    started = time.perf_counter()
    snap, ids = table.snapshot(), table.ids()
    snapshot_s = time.perf_counter() - started
    if seen != 10_000 or len(snap) != rows_so_far + 10_000 or len(ids) != len(snap):
        raise SystemExit(f"unexpected row counts: refresh {seen}, table {len(snap)}")

    print("\n## embedding_cache lookup: shared table vs the previous per-process mirror\n")
    cmd = invocation("tiercache_dev.bench.native_index", argv)
    print(f"- command: `{cmd}`; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    print(f"- {WIDTH} floats per row, one scope, flat scan, median of {args.repeats * QUERIES}")
    print("\n| rows in scope | lookup, previous (mirror) | lookup, shared table | ratio |")
    print("|---:|---:|---:|---:|")
    for size, old_us, new_us in lookups:
        print(f"| {size:,} | {old_us:.0f} us | {new_us:.0f} us | {new_us / old_us:.2f} |")
    print("\n| 10,000 new rows | cost |\n|---|---:|")
    print(f"| writer: log append only (previous) | {log_only_s * 1e3:.0f} ms |")
    print(f"| writer: log append + publish to the table | {log_publish_s * 1e3:.0f} ms |")
    print(f"| reader: previous `refresh()` (per process), per 10,000 | {refresh_s * 1e3:.0f} ms |")
    print(f"| reader: `snapshot()` + `ids()` | {snapshot_s * 1e6:.1f} us |")
    table_index.close()
    vectors.close()
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
