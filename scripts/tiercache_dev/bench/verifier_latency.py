"""The pair verifier's time for one lookup of 5 candidates, in process (issue 18's target: p50
under 15 ms), by thread count, with the weights as trained (fp32) and with torch's dynamic int8
quantization of the linear layers (what a faster verifier could run; serving runs fp32,
packed for oneDNN).

Usage::

    python -m tiercache_dev.bench.verifier_latency --verifier .perf/verifier3
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--lookups 30] [--quality]

Each lookup is one query (a pair's `b`) against 5 candidates (consecutive pairs' `a`), scored in
one batch, per source of the pairs file (its texts' lengths differ: gptcache-mock's sentences
are longer than qqp's questions). Prints p50 and p99 per (threads, weights, source);
`--quality` then judges both weights on the pairs file as `eval-semantic --verifier` does, so
the speed of int8 is seen next to what it costs in precision.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercache_dev.paths import DEFAULT_PAIRS

if TYPE_CHECKING:
    from tiercache.semantic.verifier import PairVerifier

CANDIDATES = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--lookups", type=int, default=30, help="per source and setting")
    parser.add_argument(
        "--quality",
        action="store_true",
        help="also judge fp32 and int8 on the pairs file as eval-semantic does (clusters)",
    )
    args = parser.parse_args(argv)
    import torch

    from tiercache.semantic.verifier import PairVerifier

    rows = [json.loads(line) for line in args.pairs.read_text(encoding="utf-8").splitlines()]
    by_source: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_source.setdefault(row.get("source", "-"), []).append(row)
    need = args.lookups + CANDIDATES
    print("| threads | weights | source | p50 ms | p99 ms |\n|---:|---|---|---:|---:|")
    for threads in (1, 2):
        verifier = PairVerifier(args.verifier, threads=threads)
        fp32 = verifier._model  # packed for oneDNN, as served
        # int8 from the plain layers: dynamic quantization passes over the packed ones
        plain = PairVerifier(args.verifier, threads=threads, packed_linears=False)._model
        int8 = torch.ao.quantization.quantize_dynamic(plain, {torch.nn.Linear}, dtype=torch.qint8)
        for name, model in (("fp32", fp32), ("int8", int8)):
            verifier._model = model
            for source, data in by_source.items():
                if len(data) < need:
                    continue
                times = []
                for i in range(args.lookups):
                    texts = [data[i + j]["a"] for j in range(CANDIDATES)]
                    started = time.perf_counter()
                    # a guard score for a verifier that reads one (its value costs nothing)
                    verifier.scores([data[i]["b"]] * CANDIDATES, texts, [0.5] * CANDIDATES)
                    times.append(time.perf_counter() - started)
                p50, p99 = (1000 * float(np.percentile(times, q)) for q in (50, 99))
                print(f"| {threads} | {name} | {source} | {p50:.1f} | {p99:.1f} |")
    if args.quality:
        verifier._model = fp32
        judge(args.pairs, verifier, {"fp32": fp32, "int8": int8})
    return 0


def judge(pairs_path: Path, verifier: PairVerifier, models: dict[str, Any]) -> None:
    """Precision / recall per source at a few thresholds, for each of `models` in the
    verifier, on what the guard's floor and vetoes let through (eval-semantic's protocol)."""
    from tiercache.semantic import evaluate as ev
    from tiercache.semantic.embedder import Embedder

    pairs = ev.load_pairs(pairs_path)
    corpus = ev.build_corpus(pairs)
    embedded = ev.embed_corpus(corpus, Embedder().embed)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, ev.DEFAULT_K)
    guard = ev.load_guard()
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    sources = [*corpus.sources(), ev.OVERALL]
    print("\n| weights | threshold | " + " | ".join(f"{s} P / R" for s in sources) + " |")
    print("|---|---:|" + "---|" * len(sources))
    found = {}
    for name, model in models.items():
        verifier._model = model
        found[name] = ev.verifier_scores(corpus, candidates, scores, verifier.scores)
    for t in (0.7, 0.8, 0.88):
        for name, vscores in found.items():
            counts = ev.tally(corpus, candidates, ev.choose_by_verifier(vscores, t))
            cells = " | ".join(
                f"{counts[s].precision:.3f} / {counts[s].recall:.3f}" for s in sources
            )
            print(f"| {name} | {t} | {cells} |")


if __name__ == "__main__":
    sys.exit(main())
