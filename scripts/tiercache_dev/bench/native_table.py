"""The native shared table against what the embedding cache does today, side by side in one run.

1. Publish cost per row, batches of 1, 64 and 1,024 rows of 384 floats (MiniLM's width):
   - `SharedTable.publish` (lock, copy into the shared mapping, release store, unlock);
   - plain numpy: a copy into a preallocated array of this process (the floor of any copy);
   - `SemanticStore.append_many`: the LMDB row log the embedding cache appends to today
     (one transaction per batch, LMDB's default durability: an fsync per commit).
2. Reading another process's new rows:
   - `SharedTable.snapshot()` + `ids()`: a zero-copy view, the same cost at any row count;
   - `SemanticIndex.refresh()`: today's per-process mirror catching up on the LMDB log (read,
     verify and decode each row, copy it into the process's matrix), per row.
3. A flat lookup (top 5 by inner product) in one 10,000-row scope: `SemanticIndex.search`
   (refresh check + scan of the process's matrix) against a scan of a table snapshot. The
   table side is only the vector part (no scopes, digests or prompts: that is the integration,
   still to come).

Written for part 1, before the embedding cache used the table: since part 2, `SemanticIndex`
and `SemanticStore.append_many` are the table-backed versions, so items 1 (LMDB column), 2 and 3
no longer measure the previous code. `tiercache_dev.bench.native_index` compares the two
implementations side by side (it keeps a copy of the previous mirror as its baseline).

Every figure is the median of --repeats runs; the table files live in a temporary directory
(--dir to choose one, e.g. /dev/shm). Prints Markdown tables.

Usage::

    python -m tiercache_dev.bench.native_table [--rows 8192] [--read-rows 10000] [--repeats 5]
        [--dir D]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tiercache_native as native

from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.store import SemanticStore
from tiercache_dev.stats import median

WIDTH = 384
BATCHES = (1, 64, 1024)


def unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    rows = rng.standard_normal((n, WIDTH)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def median_of(repeats: int, run: Callable[[], float]) -> float:
    return median(run() for _ in range(repeats))


def publish_costs(root: Path, batch: int, rows_per_run: int, repeats: int) -> dict[str, float]:
    """Microseconds per row for each way of appending `rows_per_run` rows in batches."""
    rng = np.random.default_rng(batch)
    rows = unit_rows(rng, rows_per_run)
    ids = np.arange(rows_per_run, dtype=np.uint64)
    batches = [(rows[i : i + batch], ids[i : i + batch]) for i in range(0, rows_per_run, batch)]
    runs = 0

    def table_run() -> float:
        nonlocal runs
        runs += 1
        table = native.SharedTable(root / f"publish-{batch}-{runs}.tbl", WIDTH, rows_per_run)
        started = time.perf_counter_ns()
        for chunk, chunk_ids in batches:
            table.publish(chunk, chunk_ids)
        return (time.perf_counter_ns() - started) / 1e3 / rows_per_run

    def numpy_run() -> float:
        matrix = np.empty((rows_per_run, WIDTH), dtype=np.float32)
        matrix[:] = 0  # touch the pages, as the table's file is reserved up front
        count = 0
        started = time.perf_counter_ns()
        for chunk, _ in batches:
            matrix[count : count + len(chunk)] = chunk
            count += len(chunk)
        return (time.perf_counter_ns() - started) / 1e3 / rows_per_run

    lmdb_rows = min(rows_per_run, 400 * batch)  # one fsync per batch: keep batch 1 short

    def lmdb_run() -> float:
        nonlocal runs
        runs += 1
        store = SemanticStore(root / f"lmdb-{batch}-{runs}", max_bytes=1 << 30)
        entries = [("scope", f"digest-{i}", f"prompt {i}", rows[i]) for i in range(lmdb_rows)]
        started = time.perf_counter_ns()
        for i in range(0, lmdb_rows, batch):
            store.append_many(entries[i : i + batch])
        elapsed = (time.perf_counter_ns() - started) / 1e3 / lmdb_rows
        store.close()
        return elapsed

    return {
        "table": median_of(repeats, table_run),
        "numpy": median_of(repeats, numpy_run),
        "lmdb": median_of(repeats, lmdb_run),
    }


def read_costs(root: Path, rows: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(7)
    vectors = unit_rows(rng, rows)
    table = native.SharedTable(root / f"read-{rows}.tbl", WIDTH, rows)
    table.publish(vectors)
    reader = native.SharedTable(root / f"read-{rows}.tbl", WIDTH, rows)

    def snapshot_run() -> float:
        started = time.perf_counter_ns()
        for _ in range(1000):
            view = reader.snapshot()
            reader.ids(len(view))
        return (time.perf_counter_ns() - started) / 1e3 / 1000

    store = SemanticStore(root / f"read-lmdb-{rows}", max_bytes=2 << 30)
    entries = [("scope", f"digest-{i}", f"prompt {i}", vectors[i]) for i in range(rows)]
    for i in range(0, rows, 1024):
        store.append_many(entries[i : i + 1024])

    def refresh_run() -> float:
        index = SemanticIndex(store, WIDTH, flat_max_rows=rows + 1, persist_graphs=False)
        started = time.perf_counter_ns()
        loaded = index.refresh()
        elapsed = (time.perf_counter_ns() - started) / 1e3
        assert loaded == rows
        return elapsed

    out = {
        "snapshot_us": median_of(repeats, snapshot_run),
        "refresh_us_per_row": median_of(repeats, refresh_run) / rows,
    }
    store.close()
    return out


def lookup_costs(root: Path, rows: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(11)
    vectors = unit_rows(rng, rows)
    queries = unit_rows(rng, 200)
    table = native.SharedTable(root / "lookup.tbl", WIDTH, rows)
    table.publish(vectors)
    store = SemanticStore(root / "lookup-lmdb", max_bytes=2 << 30)
    entries = [("scope", f"digest-{i}", f"prompt {i}", vectors[i]) for i in range(rows)]
    for i in range(0, rows, 1024):
        store.append_many(entries[i : i + 1024])
    index = SemanticIndex(store, WIDTH, flat_max_rows=rows + 1, persist_graphs=False)
    index.refresh()

    def index_run() -> float:
        started = time.perf_counter_ns()
        for q in queries:
            index.search("scope", q, k=5)
        return (time.perf_counter_ns() - started) / 1e3 / len(queries)

    def table_run() -> float:
        started = time.perf_counter_ns()
        for q in queries:
            view = table.snapshot()
            scores = view @ q
            top = np.argpartition(-scores, 4)[:5]
            top[np.argsort(-scores[top])]
        return (time.perf_counter_ns() - started) / 1e3 / len(queries)

    out = {"index": median_of(repeats, index_run), "table": median_of(repeats, table_run)}
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8192, help="rows per publish run")
    parser.add_argument("--read-rows", type=int, default=10_000, help="rows to catch up on")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where the table files go")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-native-") as tmp:
        root = Path(tmp)
        print(f"rows of {WIDTH} float32, medians of {args.repeats} runs, files in {root}\n")
        print("| batch | SharedTable.publish | numpy copy (in process) | LMDB append_many |")
        print("|---:|---:|---:|---:|")
        for batch in BATCHES:
            c = publish_costs(root, batch, args.rows, args.repeats)
            print(
                f"| {batch} | {c['table']:.3f} us/row | {c['numpy']:.3f} us/row "
                f"| {c['lmdb']:.2f} us/row |"
            )
        r = read_costs(root, args.read_rows, args.repeats)
        print(f"\n| reading {args.read_rows:,} new rows | cost |")
        print("|---|---:|")
        print(
            f"| SharedTable.snapshot() + ids() | {r['snapshot_us']:.2f} us per call (any count) |"
        )
        print(
            f"| SemanticIndex.refresh() (LMDB log -> process matrix) "
            f"| {r['refresh_us_per_row']:.2f} us/row, "
            f"{r['refresh_us_per_row'] * args.read_rows / 1e3:.1f} ms in all |"
        )
        lk = lookup_costs(root, args.read_rows, args.repeats)
        print(f"\n| flat top-5 lookup, one scope of {args.read_rows:,} rows | per query |")
        print("|---|---:|")
        print(f"| SemanticIndex.search (LMDB head check + process matrix) | {lk['index']:.0f} us |")
        print(f"| snapshot() @ q + top-5 (vectors only) | {lk['table']:.0f} us |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
