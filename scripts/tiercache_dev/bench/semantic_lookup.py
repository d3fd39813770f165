"""`make bench-semantic`: embedding_cache lookup latency with a large scope, in process.

Builds a scope of N rows (default 100,000) in a temporary state dir: random unit vectors stand in
for the stored prompts' embeddings (the worst case for the HNSW graph: no cluster structure),
with their answers in the exact cache, then times `EmbeddingCache.lookup` for real prompts with
the real embedder and guard:
- vector cached: the prompt's vector is in the vector cache (a repeat or a warmed text), so a
  lookup is vector-cache read + HNSW search + guard + answer fetch;
- vector not cached: the embedding itself included (one text per call, as a lone request).
Also prints the flat-scan cost per scope size, which is where the flat scan stops being fast
enough and the HNSW graph takes over (`flat_max_rows`), and a process's start time on that row
log side by side: rows only (no graph: the floor), cold (the graph is built, then saved), with
the saved graph, and with the saved graph plus 1,000 rows appended after it. Prints Markdown
tables; the temporary state dir is removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.exact.stores import LmdbStore, MemoryStore
from tiercache.exact.tiered import TieredCache
from tiercache.semantic import features as feats
from tiercache.semantic.embedder import Embedder
from tiercache.semantic.guard import load_guard
from tiercache.semantic.index import IndexStats, SemanticIndex
from tiercache.semantic.scope_search import ScopeSearch
from tiercache.semantic.stage import EmbeddingCache
from tiercache.semantic.store import SemanticStore
from tiercache.semantic.vectors import VectorCache
from tiercache.vocabulary import Tier
from tiercache_dev.console import invocation
from tiercache_dev.stats import median, percentile

QUERIES = [
    "What is the capital of France?",
    "How do I reset my password?",
    "Explain the difference between TCP and UDP.",
    "What are the health benefits of green tea?",
    "How many moons does Jupiter have?",
    "Write a haiku about autumn leaves.",
    "What is the best way to learn Python?",
    "Why is the sky blue?",
]


def guard_feature_costs(pairs: list[tuple[str, str]], rounds: int = 200) -> tuple[float, float]:
    """Microseconds to profile one text (not memoized) and to compute one pair's features from
    memoized profiles, as for a query against a cached prompt."""
    texts = sorted({t for pair in pairs for t in pair})
    started = time.perf_counter()
    for _ in range(rounds):
        for text in texts:
            feats.profile_text(text)
    profile_us = (time.perf_counter() - started) / (rounds * len(texts)) * 1e6
    for q, c in pairs:
        feats.features(q, c, 0.9)  # memoize the profiles
    started = time.perf_counter()
    for _ in range(rounds):
        for q, c in pairs:
            feats.features(q, c, 0.9)
    pair_us = (time.perf_counter() - started) / (rounds * len(pairs)) * 1e6
    return profile_us, pair_us


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--lookups", type=int, default=400)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-semantic-bench-"))
    print("loading the embedder and guard; state in a temp dir", flush=True)
    embedder = Embedder()
    guard = load_guard()
    dims = embedder.identity.dimensions
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((args.rows, dims)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)

    print(f"writing {args.rows:,} rows into one scope", flush=True)
    store = SemanticStore(tmp / "semantic")
    answers = TieredCache(
        [(Tier.L1, MemoryStore(64 << 20)), (Tier.L2, LmdbStore(tmp / "l2", 1 << 30))]
    )
    chunk = 10_000
    for start in range(0, args.rows, chunk):
        stop = min(args.rows, start + chunk)
        store.append_many(
            [("scope", f"d{i}", f"stored prompt {i}", vectors[i]) for i in range(start, stop)]
        )
    # Real stored prompts for the queries, so some lookups end in a guard decision on a hit.
    real = embedder.embed(QUERIES)
    for i, (text, vector) in enumerate(zip(QUERIES, real, strict=True)):
        store.append("scope", f"real{i}", text, vector)
        answers.put(f"real{i}", f"answer {i}")
    starts: list[tuple[str, float, IndexStats]] = []

    def timed_start(label: str, **kwargs: Any) -> SemanticIndex:
        index = SemanticIndex(store, dims, **kwargs)
        started = time.perf_counter()
        index.refresh()
        elapsed = time.perf_counter() - started
        starts.append((label, elapsed, index.stats()))
        print(f"start, {label}: {elapsed:.2f} s", flush=True)
        return index

    # Untimed: the first read of the row log pays for page faults that later starts do not.
    SemanticIndex(store, dims, flat_max_rows=1 << 40, persist_graphs=False).refresh()
    gc.collect()
    timed_start("rows only, no graph (flat)", flat_max_rows=1 << 40, persist_graphs=False)
    gc.collect()
    timed_start("cold: build the graph, then save it")
    gc.collect()
    index = timed_start("saved graph loaded")
    gc.collect()
    graph_files = list((store.path / "graphs").glob("*.hnsw"))
    graph_mb = sum(f.stat().st_size for f in graph_files) / 1e6
    if index.stats().graphs_loaded != 1:
        raise SystemExit("the saved graph was not loaded")
    stage = EmbeddingCache(
        VectorCache(tmp / "vectors", dims),
        index,
        answers,
        embedder.embed,
        guard.choose,
        embedder.identity.key,
    )
    reworded = [q.replace("What is", "What's").replace("How do I", "How can I") for q in QUERIES]

    cached_ms: list[float] = []
    stage.vectors_for(reworded)  # warm the vector cache
    for i in range(args.lookups):
        q = reworded[i % len(reworded)]
        t = time.perf_counter()
        stage.lookup([q], ["scope"])
        cached_ms.append((time.perf_counter() - t) * 1e3)
    uncached_ms: list[float] = []
    for i in range(min(args.lookups, 200)):
        q = f"{reworded[i % len(reworded)]} (variant {i})"
        t = time.perf_counter()
        stage.lookup([q], ["scope"])
        uncached_ms.append((time.perf_counter() - t) * 1e3)
    hits = sum(stage.lookup([q], ["scope"])[0].outcome.value == "semantic" for q in reworded)
    profile_us, pair_us = guard_feature_costs(list(zip(reworded, QUERIES, strict=True)))

    extra = rng.standard_normal((1_000, dims)).astype(np.float32)
    extra /= np.linalg.norm(extra, axis=1, keepdims=True)
    store.append_many([("scope", f"x{i}", f"appended {i}", v) for i, v in enumerate(extra)])
    del index, stage
    gc.collect()
    timed_start("saved graph loaded + 1,000 rows appended after it")

    print("\nflat scan cost per scope size (one query, numpy matrix-vector product):")
    flat_rows = []
    for n in (1_000, 10_000, 20_000, 50_000, 100_000):
        if n > args.rows:
            break
        scope = ScopeSearch("flat", dims, b"", None)  # type: ignore[arg-type]  # no table needed
        times = []
        for _ in range(30):
            t = time.perf_counter()
            scope.search(vectors[:n], vectors[3], 5)
            times.append((time.perf_counter() - t) * 1e3)
        flat_rows.append((n, median(times)))

    cmd = invocation("tiercache_dev.bench.semantic_lookup", argv)
    print(f"\n## embedding_cache lookup, {args.rows:,} rows in one scope\n")
    print(f"- command: `{cmd}`; {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    print(f"- lookups below run on the saved graph, loaded ({graph_mb:.0f} MB on disk)")
    print("\n| lookup | p50 ms | p99 ms |\n|---|---:|---:|")
    for label, values in (
        ("vector cached (search + guard + answer)", cached_ms),
        ("vector not cached (embedding included)", uncached_ms),
    ):
        print(f"| {label} | {percentile(values, 50):.3f} | {percentile(values, 99):.3f} |")
    print(f"\nsemantic hits among the {len(reworded)} reworded queries: {hits}")
    print(
        f"\nguard features: {profile_us:.1f} us to profile a text (once per text, memoized), "
        f"{pair_us:.1f} us per pair of memoized profiles ({pair_us / profile_us:.2f}x a profile)"
    )
    print("\n| rows in scope | flat scan p50 ms |\n|---:|---:|")
    for n, ms in flat_rows:
        print(f"| {n:,} | {ms:.3f} |")
    print(f"\n| process start on {args.rows:,} rows | s | graphs built / loaded / saved |")
    print("|---|---:|---|")
    for label, seconds, stats in starts:
        built, loaded, saved = stats.graphs_built, stats.graphs_loaded, stats.graphs_saved
        print(f"| {label} | {seconds:.2f} | {built} / {loaded} / {saved} |")
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
