"""What a large invalidation costs the semantic index, and how long searches wait for it
(`SemanticIndex.forget`, docs/exact_cache.md).

A scratch row log with `--scopes` scopes of 4 rows each (50 tenants), all opened by one
`SemanticIndex` (as a long-running embedding_cache holds them); then `forget` of `--digests`
answer digests, one in ten of them indexed, while another thread searches one scope every
millisecond. Reported: the forget's wall time, the rows it hid, and the searches' p50 and
longest time while it ran (a search waiting for the index's lock shows as a long one).

Usage::

    python -m tiercache_dev.bench.semantic_forget [--scopes 2000] [--digests 5000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tiercache.semantic.index import SemanticIndex
from tiercache.semantic.store import SemanticStore
from tiercache_dev.console import invocation, progress

DIMENSIONS = 8
ROWS_PER_SCOPE = 4


def measure(scopes: int, digests: int, folder: Path) -> dict[str, float]:
    store = SemanticStore(folder / "sem")
    index = SemanticIndex(store, DIMENSIONS, 10_000, persist_graphs=False)
    rng = np.random.default_rng(1)

    def unit() -> np.ndarray:
        v = rng.standard_normal(DIMENSIONS).astype(np.float32)
        return v / np.linalg.norm(v)

    for s in range(scopes):
        rows = [(f"scope{s}", f"d{s}-{r}", f"p{s}-{r}", unit()) for r in range(ROWS_PER_SCOPE)]
        store.append_many(rows, tenants={f"scope{s}": f"tenant{s % 50}"})
    for s in range(scopes):
        index.search(f"scope{s}", unit(), k=1)  # this process opens every scope
    wanted = [
        f"d{i % scopes}-{i % ROWS_PER_SCOPE}" if i % 10 == 0 else f"unknown{i}"
        for i in range(digests)
    ]
    waits: list[float] = []
    stop = threading.Event()
    query = unit()

    def searcher() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            index.search("scope0", query, k=1)
            waits.append(time.perf_counter() - started)
            time.sleep(0.001)

    thread = threading.Thread(target=searcher)
    thread.start()
    time.sleep(0.2)
    started = time.perf_counter()
    hidden = index.forget(wanted)
    took = time.perf_counter() - started
    time.sleep(0.2)
    stop.set()
    thread.join()
    index.close()
    return {
        "forget_ms": took * 1e3,
        "hidden": hidden,
        "search_p50_ms": statistics.median(waits) * 1e3,
        "search_max_ms": max(waits) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scopes", type=int, default=2000, help="open scopes (2000)")
    parser.add_argument("--digests", type=int, default=5000, help="digests forgotten (5000)")
    args = parser.parse_args(argv)
    if args.scopes < 1 or args.digests < 1:
        parser.error("--scopes and --digests must be at least 1")
    progress(f"semantic_forget: {args.scopes} scopes, {args.digests} digests")
    with tempfile.TemporaryDirectory(prefix="tiercache-semantic-forget-") as tmp:
        r = measure(args.scopes, args.digests, Path(tmp))
    print(f"`{invocation('tiercache_dev.bench.semantic_forget', argv)}`\n")
    print("| scopes | digests | forget ms | rows hidden | search p50 ms | longest search ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.scopes:,} | {args.digests:,} | {r['forget_ms']:.0f} | {r['hidden']:,.0f} | "
        f"{r['search_p50_ms']:.2f} | {r['search_max_ms']:.1f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
