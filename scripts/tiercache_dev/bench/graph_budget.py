"""What one scope's HNSW graph costs in memory and saves per search: the figures the graphs'
budget trades (issue 20; `SemanticIndex.resize_graphs`, docs/budgets.md).

For each size, one scope of that many random unit rows of 384 floats (the shipped embedder's
width) in a scratch row log; a `SemanticIndex` that gives it a graph (`flat_max_rows` under the
size) is searched with and without its graph (`resize_graphs(0)` drops it: the same rows,
scanned flat), interleaved, one query at a time. Reported: each way's median search time, what
the graph saves per search, the bytes the budget charges for it (`graph_bytes_for`) and how
much the process's resident memory grew when the graph was built (which includes the scope's
shared table, read to build it: file-backed pages the host shares, shown beside it), and the
seconds saved per search per MiB: what the budget's value compares with the other caches'.

Usage::

    python -m tiercache_dev.bench.graph_budget [--sizes 10000,30000] [--queries 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.store import SemanticStore
from tiercache_dev.console import invocation, progress

DIMENSIONS = 384
MIB = 1 << 20


def rows_of(count: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((count, DIMENSIONS)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def measure(size: int, queries: int, folder: Path) -> dict[str, float]:
    store = SemanticStore(folder / f"sem-{size}", 1 << 33, dimensions=DIMENSIONS)
    rows = rows_of(size, size)
    for start in range(0, size, 5000):
        chunk = rows[start : start + 5000]
        store.append_many([("s", f"d{start + i}", f"p{start + i}", v) for i, v in enumerate(chunk)])
    index = SemanticIndex(store, DIMENSIONS, flat_max_rows=size // 2, persist_graphs=True)
    process = psutil.Process()
    before = process.memory_info().rss
    index.refresh()  # builds the graph (and saves it: coming back is a load)
    grown = process.memory_info().rss - before
    charged = index.graph_bytes()
    asked = rows_of(queries, size + 1)
    with_graph: list[float] = []
    flat: list[float] = []
    for round_ in range(2):  # interleaved: graph, flat, graph, flat
        for ways, budget in ((with_graph, 1 << 40), (flat, 0)):
            index.resize_graphs(budget)
            if budget:
                index.search("s", asked[0], k=5)
                index.wait_graphs()
            index.search("s", asked[0], k=5)
            for query in asked[round_::2]:
                started = time.perf_counter()
                index.search("s", query, k=5)
                ways.append(time.perf_counter() - started)
    index.close()
    graph_s, flat_s = statistics.median(with_graph), statistics.median(flat)
    return {
        "rows": size,
        "graph_ms": graph_s * 1e3,
        "flat_ms": flat_s * 1e3,
        "saved_ms": (flat_s - graph_s) * 1e3,
        "charged_mib": charged / MIB,
        "rss_mib": grown / MIB,
        "table_mib": size * DIMENSIONS * 4 / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,30000", help="rows per scope (10000,30000)")
    parser.add_argument("--queries", type=int, default=200, help="searches each way (200)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    results = []
    with tempfile.TemporaryDirectory(prefix="tiercache-graph-budget-") as tmp:
        for size in sizes:
            progress(f"graph_budget: {size} rows")
            results.append(measure(size, args.queries, Path(tmp)))
    print(f"`{invocation('tiercache_dev.bench.graph_budget', argv)}`\n")
    print(
        "| rows | search with graph p50 ms | flat p50 ms | saved per search ms | charged MiB | "
        "RSS growth MiB (the table's pages MiB) | saved ms per search per charged MiB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['rows']:,.0f} | {r['graph_ms']:.3f} | {r['flat_ms']:.3f} | "
            f"{r['saved_ms']:.3f} | {r['charged_mib']:.1f} | "
            f"{r['rss_mib']:.1f} ({r['table_mib']:.1f}) | "
            f"{r['saved_ms'] / r['charged_mib']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
