"""Train the semantic hit guard and write python_backend/tiercache/semantic/guard_model.json.

Usage::

    .venv/bin/python -m tiercache_dev.train.guard [--pairs ../shared/eval/semantic_pairs_dev.jsonl]
        [--k 5] [--folds 5] [--C 1.0] [--out python_backend/tiercache/semantic/guard_model.json]
        [--embeddings-cache FILE.npz] [--dry-run] [--perturbed-out FILE.jsonl]

Steps (deterministic: exact search, a seeded fold assignment, a deterministic solver):

1. Load the pairs, normalize texts, insert side `a` (deduplicated), embed every distinct text
   with the packaged embedder (all-MiniLM-L6-v2).
2. For each pair, its query `b` gets its k nearest inserted texts; each candidate at or above the
   cosine floor on which no veto fires is a training example, labelled 1 iff serving it is a
   correct hit (label-1 pair and the candidate is the pair's own `a`). Candidates whose text
   equals the query but are not the pair's own `a` (another pair holds the identical question)
   are left out of training: they are "false" only by the bookkeeping of the protocol.
3. Cross-validation by pair, grouped so that pairs sharing a text (Quora's question clusters)
   fall in one fold: `--folds` folds, each scored by a model trained on the others (coefficients
   rounded to 4 decimals as shipped).
4. The out-of-fold scores run through the full protocol (best accepted candidate of the top k
   wins) at every threshold of a grid: held-out precision and recall per source and overall.
5. Calibration: a source whose held-out precision reaches REQUIRED_PRECISION at some threshold
   (with at least MIN_HITS hits) is a calibration source; the operating table's precision and
   recall are pooled over the calibration sources, rows with fewer than MIN_HITS hits dropped.
   A source that never reaches it is named in the model with its best precision (on the dev
   file, qqp: duplicate question clusters cap its strict precision; see docs/semantic_guard.md).
   No calibration source: every source is pooled.
6. The default target precision is REQUIRED_PRECISION when the table reaches it, else the best
   the table reaches; the final model is fitted on every example.

`--perturbed-out FILE` also writes a synthetic check set (nothing is trained on it): the dev
file's label-1 pairs plus, for each, label-0 variants of its `a` with a number changed, a
negation inserted or a named entity swapped for another pair's, as sources
`perturbed-number`, `perturbed-negation`, `perturbed-entity`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import random
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.semantic import evaluate as ev
from tiercache.semantic import features as feats
from tiercache.semantic.embedder import DEFAULT_EMBEDDER, KNOWN_EMBEDDERS
from tiercache.semantic.guard import MODEL_FORMAT, MODEL_PATH
from tiercache_dev.paths import DEFAULT_PAIRS, REPO_ROOT

COSINE_FLOOR = 0.6
REQUIRED_PRECISION = 0.97
MIN_HITS = 50
# Vetoes: the feature value at which a candidate is rejected whatever its score. General
# linguistic rules, not fitted: a changed number, a negation flip between otherwise near-identical
# texts, a named entity swapped on both sides, two roles swapped around a pivot word.
VETOES = {
    "number_mismatch": 1.0,
    "negation_mismatch": 1.0,
    "entity_mismatch": 1.0,
    "role_swap": 1.0,
}
THRESHOLDS = tuple(round(t, 3) for t in np.arange(0.02, 0.995, 0.01))
SEED = 20240601


def display(path: Path) -> str:
    """A path relative to the repository (or its parent); never an absolute path."""
    resolved = path.resolve()
    for base, prefix in ((REPO_ROOT, ""), (REPO_ROOT.parent, "../")):
        try:
            return prefix + str(resolved.relative_to(base))
        except ValueError:
            continue
    return path.name


def groups_by_shared_text(pairs: Sequence[ev.Pair]) -> np.ndarray:
    """Connected components of pairs linked by a shared (normalized) text on either side."""
    parent = list(range(len(pairs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, pair in enumerate(pairs):
        for text in (pair.a, pair.b):
            ri, rj = find(i), find(first.setdefault(text, i))
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) for i in range(len(pairs))], dtype=np.int64)


def fold_of(groups: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Fold per pair: groups shuffled with `seed`, then dealt round-robin."""
    order = np.random.default_rng(seed).permutation(np.unique(groups))
    assignment = {int(g): i % folds for i, g in enumerate(order)}
    return np.array([assignment[int(g)] for g in groups], dtype=np.int64)


def fit(x: np.ndarray, y: np.ndarray, c: float) -> tuple[np.ndarray, float]:
    """L2 logistic regression; coefficients rounded as they are shipped."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, solver="lbfgs", max_iter=10_000, tol=1e-8)
    model.fit(x, y)
    return np.round(model.coef_[0], 4), round(float(model.intercept_[0]), 4)


def scores_of(matrix: np.ndarray, coef: np.ndarray, intercept: float) -> np.ndarray:
    """Guard scores as `SemanticGuard.score_matrix` computes them (floor and vetoes -> 0)."""
    z = matrix @ coef + intercept
    blocked = (matrix[..., 0] < COSINE_FLOOR) | vetoed(matrix)
    return np.where(blocked, 0.0, 1.0 / (1.0 + np.exp(-z)))


def vetoed(matrix: np.ndarray) -> np.ndarray:
    out = np.zeros(matrix.shape[:-1], dtype=bool)
    for name, value in VETOES.items():
        out |= matrix[..., feats.FEATURE_NAMES.index(name)] >= value
    return out


def pooled(counts: dict[str, ev.Tally], sources: Sequence[str]) -> ev.Tally:
    parts = [counts[s] for s in sources]
    return ev.Tally(
        correct=sum(t.correct for t in parts),
        false=sum(t.false for t in parts),
        miss=sum(t.miss for t in parts),
        positives=sum(t.positives for t in parts),
        pairs=sum(t.pairs for t in parts),
    )


def robust_threshold(rows: list[tuple[float, ev.Tally]], target: float) -> int | None:
    """Index of the lowest row from which on every row's precision >= target."""
    chosen = None
    for i in range(len(rows) - 1, -1, -1):
        if rows[i][1].precision < target:
            break
        chosen = i
    return chosen


# --- the synthetic check set ----------------------------------------------------------------

_AUX = re.compile(
    r"\b(is|are|was|were|can|could|do|does|did|should|will|would|has|have|must)\b", re.IGNORECASE
)
_DIGITS = re.compile(r"\b\d+\b")
_CAPITALIZED = re.compile(r"(?<=\w )([A-Z][a-z]{2,})\b")


def perturbations(pairs: Sequence[ev.Pair], seed: int) -> list[dict[str, Any]]:
    """Label-0 variants of each label-1 pair's `a` (see the module docstring)."""
    rng = random.Random(seed)
    entity_pool = sorted(
        {
            m.group(1)
            for p in pairs
            for m in _CAPITALIZED.finditer(p.a)
            if m.group(1).lower() not in feats.STOPWORDS
        }
    )
    out: list[dict[str, Any]] = []
    for pair in pairs:
        if pair.label != 1:
            continue
        out.append({"a": pair.a, "b": pair.b, "label": 1, "source": pair.source})
        a = pair.a
        match = _DIGITS.search(a)
        if match:
            changed = str(int(match.group(0)) + rng.randint(1, 9))
            b = a[: match.start()] + changed + a[match.end() :]
            out.append({"a": a, "b": b, "label": 0, "source": "perturbed-number"})
        match = _AUX.search(a)
        if match and " not " not in a and "n't" not in a:
            b = a[: match.end()] + " not" + a[match.end() :]
            out.append({"a": a, "b": b, "label": 0, "source": "perturbed-negation"})
        match = _CAPITALIZED.search(a)
        if match and entity_pool:
            other = entity_pool[rng.randrange(len(entity_pool))]
            if other.lower() not in a.lower():
                b = a[: match.start(1)] + other + a[match.end(1) :]
                out.append({"a": a, "b": b, "label": 0, "source": "perturbed-entity"})
    return out


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--k", type=int, default=ev.DEFAULT_K)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--C", type=float, default=1.0, dest="c")
    parser.add_argument("--out", type=Path, default=MODEL_PATH)
    parser.add_argument("--embeddings-cache", type=Path, help="reuse/keep embeddings (.npz)")
    parser.add_argument("--dry-run", action="store_true", help="do not write the model")
    parser.add_argument("--perturbed-out", type=Path, help="also write the synthetic check set")
    parser.add_argument(
        "--judge",
        choices=("own-a", "clusters"),
        default="own-a",
        help="which hits are labelled correct: the pair's own a only (how the packaged model "
        "was trained), or any text of the query's duplicate cluster (the file's "
        "cluster_a/cluster_b; tiercache.semantic.evaluate)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()

    def say(line: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {line}", flush=True)

    pairs = ev.load_pairs(args.pairs)
    corpus = ev.build_corpus(pairs)
    if args.judge == "own-a":
        corpus = dataclasses.replace(corpus, inserted_cluster=None, query_cluster=None)
    elif corpus.rule != "clusters":
        parser.error(f"--judge clusters: {args.pairs} carries no cluster_a/cluster_b")
    sources = corpus.sources()
    say(
        f"{len(pairs)} pairs from {display(args.pairs)}, {len(corpus.inserted)} inserted texts, "
        f"hits judged by {corpus.rule}"
    )
    if args.perturbed_out is not None:
        rows_out = perturbations(pairs, SEED)
        args.perturbed_out.write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows_out), encoding="utf-8"
        )
        say(f"wrote {len(rows_out)} check pairs to {display(args.perturbed_out)}")

    embedded = None
    if args.embeddings_cache is not None and args.embeddings_cache.is_file():
        data = np.load(args.embeddings_cache)
        if data["inserted"].shape[0] == len(corpus.inserted) and data["queries"].shape[0] == len(
            pairs
        ):
            embedded = ev.Embedded(data["inserted"], data["queries"], 0.0, 0)
            say(f"embeddings from {args.embeddings_cache.name}")
    if embedded is None:
        from tiercache.semantic.embedder import Embedder

        embedded = ev.embed_corpus(corpus, Embedder().embed, say)
        say(f"embedded {embedded.texts} texts ({embedded.ms_per_text:.2f} ms per text)")
        if args.embeddings_cache is not None:
            np.savez(args.embeddings_cache, inserted=embedded.inserted, queries=embedded.queries)

    candidates = ev.search_topk(embedded.inserted, embedded.queries, args.k)
    matrix = ev.candidate_features(corpus, candidates)
    correct = ev.correct_candidates(corpus, candidates)
    query_texts = np.array([p.b for p in pairs], dtype=object)
    candidate_texts = np.array(corpus.inserted, dtype=object)[candidates.index]
    same_text = (candidate_texts == query_texts[:, None]) & (
        candidates.index != corpus.own[:, None]
    )
    usable = (candidates.cosine >= COSINE_FLOOR) & ~same_text & ~vetoed(matrix)
    say(
        f"top-{args.k} search and features done: {int(usable.sum())} training candidates "
        f"({int((usable & correct).sum())} correct); {int(same_text.sum())} identical-text "
        f"neighbours and {int((vetoed(matrix) & (candidates.cosine >= COSINE_FLOOR)).sum())} "
        "vetoed candidates left out"
    )

    fold = fold_of(groups_by_shared_text(pairs), args.folds, SEED)
    oof = np.zeros(candidates.cosine.shape, dtype=np.float64)
    for f in range(args.folds):
        train = (fold != f)[:, None] & usable
        coef, intercept = fit(matrix[train], correct[train].astype(int), args.c)
        held = fold == f
        oof[held] = scores_of(matrix[held], coef, intercept)
        say(f"fold {f + 1}/{args.folds}: trained on {int(train.sum())} candidates")

    grid = [
        (t, ev.tally(corpus, candidates, ev.choose_by_score(oof, candidates.cosine, t, 0.0)))
        for t in THRESHOLDS
    ]
    best_by_source = {
        s: max(
            (c[s].precision for _, c in grid if c[s].correct + c[s].false >= MIN_HITS),
            default=float("nan"),
        )
        for s in sources
    }
    calibration = [s for s in sources if best_by_source[s] >= REQUIRED_PRECISION] or sources
    excluded = {s: round(best_by_source[s], 4) for s in sources if s not in calibration}
    say(f"held-out best precision per source: {best_by_source}")
    say(f"calibration sources: {calibration}; excluded (best precision): {excluded}")

    table: list[tuple[float, ev.Tally, dict[str, ev.Tally]]] = []
    for t, counts in grid:
        cal = pooled(counts, calibration)
        if cal.correct + cal.false >= MIN_HITS:
            table.append((t, cal, counts))
    index = robust_threshold([(t, cal) for t, cal, _ in table], REQUIRED_PRECISION)
    if index is not None:
        default_target = REQUIRED_PRECISION
    else:
        best = max(cal.precision for _, cal, _ in table)
        default_target = float(np.floor(best * 1000) / 1000)
        index = robust_threshold([(t, cal) for t, cal, _ in table], default_target)
        say(f"the table never reaches {REQUIRED_PRECISION}; default target {default_target}")
    assert index is not None
    d_threshold, d_cal, d_counts = table[index]
    say(f"default target precision {default_target} -> threshold {d_threshold} (held-out):")
    for source, t in d_counts.items():
        say(
            f"  {source:<14} correct {t.correct:5d} false {t.false:4d} miss {t.miss:5d} "
            f"precision {t.precision:.4f} recall {t.recall:.4f}"
        )

    coef, intercept = fit(matrix[usable], correct[usable].astype(int), args.c)
    say(
        "final model: "
        + ", ".join(f"{n} {w:+.4f}" for n, w in zip(feats.FEATURE_NAMES, coef, strict=True))
    )
    say(f"intercept {intercept:+.4f}")

    def cell(t: ev.Tally) -> list[float | None]:
        p = None if np.isnan(t.precision) else round(t.precision, 4)
        return [p, round(t.recall, 4)]

    model: dict[str, Any] = {
        "format": MODEL_FORMAT,
        "embedder": KNOWN_EMBEDDERS[DEFAULT_EMBEDDER].embedder_id,
        "features": list(feats.FEATURE_NAMES),
        "coefficients": [float(w) for w in coef],
        "intercept": intercept,
        "cosine_floor": COSINE_FLOOR,
        "vetoes": VETOES,
        "default_target_precision": default_target,
        "calibration": {
            "sources": calibration,
            "excluded_sources_best_precision": excluded,
            "required_precision": REQUIRED_PRECISION,
            "min_hits_per_row": MIN_HITS,
            "default_threshold": d_threshold,
        },
        "operating_table": {
            "columns": ["threshold", "precision", "recall", "overall [precision, recall]"]
            + [f"{s} [precision, recall]" for s in sources],
            "measured_on": (
                "out-of-fold scores, full protocol (best accepted of top-k); precision and "
                "recall pooled over the calibration sources"
            ),
            "rows": [
                [t, round(cal.precision, 4), round(cal.recall, 4), cell(counts[ev.OVERALL])]
                + [cell(counts[s]) for s in sources]
                for t, cal, counts in table
            ],
        },
        "training": {
            "date": dt.date.today().isoformat(),
            "script": "python -m tiercache_dev.train.guard",
            "pairs_file": display(args.pairs),
            "pairs": len(pairs),
            "by_source": {
                s: {
                    "pairs": sum(p.source == s for p in pairs),
                    "positives": sum(p.source == s and p.label == 1 for p in pairs),
                }
                for s in sources
            },
            "inserted_texts": len(corpus.inserted),
            "k": args.k,
            "training_candidates": int(usable.sum()),
            "correct_candidates": int((usable & correct).sum()),
            "folds": args.folds,
            "fold_grouping": "pairs sharing a normalized text are in one fold",
            "seed": SEED,
            "model": f"logistic regression, L2, C={args.c}, lbfgs, unscaled features",
            "held_out_at_default": {s: t.as_dict() for s, t in d_counts.items()},
        },
    }
    if args.dry_run:
        say("dry run: model not written")
    else:
        args.out.write_text(dump_model(model), encoding="utf-8")
        say(f"wrote {display(args.out)}")
    return 0


def dump_model(model: dict[str, Any]) -> str:
    """Indented JSON with each operating-table row on one line."""
    rows = model["operating_table"]["rows"]
    placeholder = "__ROWS__"
    body = json.dumps(
        {**model, "operating_table": {**model["operating_table"], "rows": placeholder}}, indent=1
    )
    lines = ",\n".join("   " + json.dumps(r) for r in rows)
    return body.replace(f'"{placeholder}"', "[\n" + lines + "\n  ]") + "\n"


if __name__ == "__main__":
    sys.exit(main())
