"""Training pairs for the semantic verifier as serving meets them (issue 18, item 1): the
candidates the index and the guard's vetoes hand the verifier, labelled by duplicate clusters.

Usage::

    .venv/bin/python -m tiercache_dev.train.qqp_pairs --source FILE --split train --clusters \\
        --out .perf/qqp_train_c.jsonl
    .venv/bin/python -m tiercache_dev.train.hard_pairs --pairs .perf/qqp_train_c.jsonl \\
        --out .perf/verifier_pairs.jsonl [--block 5000] [--k 5] [--swap]

Reads a pairs file of QQP's train split with clusters (every row must be a train row) and runs,
block by block (`--block` pairs, about the dev file's size, so that neighbours are as dense as
there), what `tiercache eval-semantic` runs: every `a` inserted, every `b` searched for its
top `--k` by cosine, the guard's floor and vetoes. Every candidate they let through becomes one
line `{"a": query, "b": candidate, "label", "index", "rank", "cosine", "guard"}`, `label` 1 when
serving it is a correct hit by the clusters rule (`tiercache.semantic.evaluate.Corpus.correct`);
the pair itself (`rank` -1) follows when its own `a` was not among them, so no labelled pair is
lost. These are the verifier's hard cases: near neighbours that ask something else.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tiercache_dev.console import progress
from tiercache_dev.paths import PERF_DIR
from tiercache_dev.train.qqp_pairs import split_of

if TYPE_CHECKING:
    from tiercache.semantic.evaluate import Pair
    from tiercache.semantic.guard import SemanticGuard
    from tiercache.semantic.stage import EmbedFn


def train_indices(path: Path) -> list[int]:
    """Each non-blank line's QQP `index`; SystemExit naming the first outside the train split."""
    found = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            index = json.loads(line).get("index")
            if not isinstance(index, int) or split_of(index) != "train":
                raise SystemExit(f"{path}:{number}: not a row of QQP's train split: {index!r}")
            found.append(index)
    return found


def mine(
    pairs: Sequence[Pair],
    indices: Sequence[int],
    embed: EmbedFn,
    guard: SemanticGuard,
    block: int = 5000,
    k: int = 5,
) -> Iterator[dict[str, Any]]:
    """The module's lines for `pairs` (with clusters; `indices` their QQP row indices)."""
    from tiercache.semantic.evaluate import (
        build_corpus,
        candidate_features,
        embed_corpus,
        search_topk,
    )

    for begin in range(0, len(pairs), block):
        part = pairs[begin : begin + block]
        progress(f"block {begin // block + 1}: pairs {begin}..{begin + len(part)}")
        corpus = build_corpus(part)
        embedded = embed_corpus(corpus, embed)
        candidates = search_topk(embedded.inserted, embedded.queries, k)
        scores = guard.score_matrix(candidate_features(corpus, candidates))
        correct = corpus.correct(candidates.index)
        for i, pair in enumerate(part):
            index = indices[begin + i]
            seen_own = False
            for j in np.nonzero(scores[i] > 0.0)[0].tolist():
                served = int(candidates.index[i, j])
                seen_own |= served == int(corpus.own[i])
                yield {
                    "a": pair.b,
                    "b": corpus.inserted[served],
                    "label": int(correct[i, j]),
                    "index": index,
                    "rank": j,
                    "cosine": round(float(candidates.cosine[i, j]), 4),
                    "guard": round(float(scores[i, j]), 4),
                }
            if not seen_own:
                yield {"a": pair.b, "b": pair.a, "label": pair.label, "index": index, "rank": -1}


def swapped(pair: Pair) -> Pair:
    """`pair` with its sides (and their clusters) exchanged: which one was asked first is
    arbitrary in QQP, so the other order is as real a case."""
    from tiercache.semantic.evaluate import Pair

    return Pair(pair.b, pair.a, pair.label, pair.source, pair.cluster_b, pair.cluster_a)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, required=True, help="train split with clusters")
    parser.add_argument("--out", type=Path, default=PERF_DIR / "verifier_pairs.jsonl")
    parser.add_argument("--block", type=int, default=5000, help="pairs searched together")
    parser.add_argument("--k", type=int, default=5, help="candidates per query")
    parser.add_argument(
        "--swap",
        action="store_true",
        help="each pair's sides swapped first: every b inserted, every a searched (other "
        "queries, other neighbours: as many cases again from the same rows)",
    )
    args = parser.parse_args(argv)

    from tiercache.semantic.embedder import Embedder
    from tiercache.semantic.evaluate import load_guard, load_pairs

    pairs = load_pairs(args.pairs)
    indices = train_indices(args.pairs)
    if len(indices) != len(pairs):  # the two readings of the file must agree line for line
        raise SystemExit(f"{args.pairs}: {len(pairs)} pairs but {len(indices)} indices")
    if pairs[0].cluster_a is None:
        raise SystemExit(f"{args.pairs}: no clusters (qqp_pairs --clusters)")
    if args.swap:
        pairs = [swapped(pair) for pair in pairs]
    rows = mine(pairs, indices, Embedder().embed, load_guard(), args.block, args.k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = positives = 0
    with args.out.open("w", encoding="utf-8") as handle:
        for line in rows:
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
            written += 1
            positives += line["label"]
    progress(f"{written} pairs ({positives} same question) from {len(pairs)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
