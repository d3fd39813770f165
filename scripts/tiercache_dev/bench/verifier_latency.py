"""The pair verifier's time for one lookup of 5 candidates, in process (issue 18's target: p50
under 15 ms), by thread count and number format (`verifier_dtype`: float32 as trained,
bfloat16, int8; float32 and bfloat16 packed for oneDNN, as served).

Usage::

    python -m tiercache_dev.bench.verifier_latency --verifier builtin
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--lookups 40] [--quality]

Each lookup is one query (a pair's `b`) against 5 candidates (consecutive pairs' `a`), scored in
one batch, per source of the pairs file (its texts' lengths differ: gptcache-mock's sentences
are longer than qqp's questions); the formats take turns lookup by lookup, so the machine's
noise falls on all alike. Prints p50 and p99 per (threads, format, source); `--quality` then
judges every format on the pairs file as `eval-semantic --verifier` does, so the speed of each
is seen next to what it costs in precision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tiercache_dev.paths import DEFAULT_PAIRS

if TYPE_CHECKING:
    from tiercache.semantic.verifier import PairVerifier

CANDIDATES = 5
FORMATS_TIMED = ("float32", "bfloat16", "int8")  # every format `auto` can stand for
WARM_UP = 3  # lookups per format not timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--lookups", type=int, default=40, help="per source and setting")
    parser.add_argument(
        "--quality",
        action="store_true",
        help="also judge every format on the pairs file as eval-semantic does (clusters)",
    )
    args = parser.parse_args(argv)
    from tiercache.semantic.verifier import PairVerifier

    rows = [json.loads(line) for line in args.pairs.read_text(encoding="utf-8").splitlines()]
    by_source: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_source.setdefault(row.get("source", "-"), []).append(row)
    need = args.lookups + WARM_UP + CANDIDATES
    print("| threads | format | source | p50 ms | p99 ms |\n|---:|---|---|---:|---:|")
    verifiers: dict[str, PairVerifier] = {}
    for threads in (1, 2):
        verifiers = {
            d: PairVerifier(args.verifier, threads=threads, dtype=d) for d in FORMATS_TIMED
        }
        for source, data in by_source.items():
            if len(data) < need:
                continue
            times: dict[str, list[float]] = {d: [] for d in FORMATS_TIMED}
            for i in range(args.lookups + WARM_UP):
                texts = [data[i + j]["a"] for j in range(CANDIDATES)]
                for dtype, verifier in verifiers.items():
                    started = time.perf_counter()
                    # a guard score for a verifier that reads one (its value costs nothing)
                    verifier.scores([data[i]["b"]] * CANDIDATES, texts, [0.5] * CANDIDATES)
                    if i >= WARM_UP:
                        times[dtype].append(time.perf_counter() - started)
            for dtype in FORMATS_TIMED:
                p50, p99 = (1000 * float(np.percentile(times[dtype], q)) for q in (50, 99))
                print(f"| {threads} | {dtype} | {source} | {p50:.1f} | {p99:.1f} |")
    if args.quality:
        judge(args.pairs, verifiers)
    return 0


def judge(pairs_path: Path, verifiers: dict[str, PairVerifier]) -> None:
    """Precision / recall per source at a few thresholds (the shipped verifier's point among
    them) for each of `verifiers`, on what the guard's floor and vetoes let through
    (eval-semantic's protocol)."""
    from tiercache.semantic import evaluate as ev
    from tiercache.semantic.embedder import Embedder, Screen

    pairs = ev.load_pairs(pairs_path)
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, Embedder().embed, screen=Screen().check)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, ev.DEFAULT_K)
    guard = ev.load_guard()
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    sources = [*corpus.sources(), ev.OVERALL]
    print("\n| format | threshold | " + " | ".join(f"{s} P / R" for s in sources) + " |")
    print("|---|---:|" + "---|" * len(sources))
    found = {}
    for name, verifier in verifiers.items():
        found[name] = ev.served_exactly(
            corpus, candidates, ev.verifier_scores(corpus, candidates, scores, verifier.scores)
        )
    points = {v.default_threshold for v in verifiers.values()} - {None}
    for t in sorted({0.7, 0.79, 0.85, *points}):
        for name, vscores in found.items():
            counts = ev.tally(corpus, candidates, ev.choose_by_verifier(vscores, t))
            cells = " | ".join(
                f"{counts[s].precision:.3f} / {counts[s].recall:.3f}" for s in sources
            )
            print(f"| {name} | {t} | {cells} |")


if __name__ == "__main__":
    sys.exit(main())
