"""Choose a trained verifier's operating point on the dev pairs (issue 18) and write it into its
`verifier.json`, where serving reads its default threshold.

Usage::

    .venv/bin/python -m tiercache_dev.train.verifier_point --verifier .perf/verifier \\
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--target 0.95] [--write]

Runs what `tiercache eval-semantic --verifier` runs (the packaged guard's floor and vetoes, the
verifier on the candidates left, judged by duplicate clusters) once, sweeps the threshold from
0.50 to 0.999, and prints every point. The chosen one has the most overall recall among those
whose overall precision, and each source's, is at least `--target` (`--source-target S=P`
sets it for one source, e.g. gptcache-mock=0.97; `--overall-only`: `--target` holds overall,
and a source only where `--source-target` names it). `--write` records it as `operating_point`
(threshold, the pairs file, its figures) in `verifier.json`. Only the dev file is for this:
never choose a point on held-out pairs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.semantic.verifier import DTYPES
from tiercache_dev.console import progress
from tiercache_dev.paths import DEFAULT_PAIRS

GRID = tuple(
    float(t)
    for t in np.round(
        np.concatenate([np.arange(0.5, 0.99, 0.01), np.arange(0.99, 0.9995, 0.001)]), 3
    )
)


def choose(
    rows: list[dict[str, Any]],
    target: float,
    source_targets: dict[str, float],
    each_source: bool = True,
) -> dict[str, Any] | None:
    """The row (threshold plus per-source figures, OVERALL included) with the most overall
    recall whose precision meets `target` overall and, with `each_source`, for every source
    (`source_targets` setting it per source; without `each_source` only the sources it names
    are held to one); ties go to the lower threshold. None when no row qualifies."""
    from tiercache.semantic.evaluate import OVERALL

    best = None
    for row in rows:
        figures = row["by_source"]
        if figures[OVERALL]["precision"] is None:
            continue  # no hit at all

        # a source without hits has no false hit: it does not disqualify the row
        def needed(source: str) -> float:
            if source == OVERALL or each_source:
                return source_targets.get(source, target)
            return source_targets.get(source, 0.0)

        if any(
            c["precision"] is not None and c["precision"] < needed(s) for s, c in figures.items()
        ):
            continue
        if best is None or figures[OVERALL]["recall"] > best["by_source"][OVERALL]["recall"]:
            best = row
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--verifier", type=Path, required=True, help="a trained verifier folder, or builtin"
    )
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="the dev pairs")
    parser.add_argument("--target", type=float, default=0.95, help="precision to keep")
    parser.add_argument(
        "--source-target",
        action="append",
        default=[],
        metavar="SOURCE=P",
        help="a higher precision for one source",
    )
    parser.add_argument(
        "--overall-only",
        action="store_true",
        help="--target holds overall; a source is held only to its --source-target",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the number format the verifier runs in (float32: as trained)",
    )
    parser.add_argument("--write", action="store_true", help="record the point in verifier.json")
    args = parser.parse_args(argv)
    source_targets = {}
    for item in args.source_target:
        name, _, value = item.partition("=")
        source_targets[name] = float(value)

    from tiercache.semantic import evaluate as ev
    from tiercache.semantic.embedder import Embedder, Screen
    from tiercache.semantic.verifier import (
        INFO_FILE,
        PairVerifier,
        check_guard,
        verifier_folder,
    )

    pairs = ev.load_pairs(args.pairs)
    corpus = ev.build_corpus(pairs)
    if corpus.rule != "clusters":
        raise SystemExit(f"{args.pairs}: no clusters; the point is chosen on clustered pairs")
    guard = ev.load_guard()
    # as serving decides (and eval-semantic evaluates): texts the screen refuses are never
    # candidates nor looked up, and a query identical to an inserted text is an exact hit
    embedded = ev.embed_corpus(corpus, Embedder().embed, progress, screen=Screen().check)
    candidates = ev.search_topk(embedded.inserted, embedded.queries, ev.DEFAULT_K)
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    verifier = PairVerifier(args.verifier, dtype=args.dtype)
    check_guard(verifier, guard, args.verifier)
    vscores = ev.served_exactly(
        corpus,
        candidates,
        ev.verifier_scores(corpus, candidates, scores, verifier.scores, progress),
    )
    rows: list[dict[str, Any]] = []
    for t in GRID:
        counts = ev.tally(corpus, candidates, ev.choose_by_verifier(vscores, t))
        rows.append({"threshold": t, "by_source": {s: c.as_dict() for s, c in counts.items()}})
    sources = [*corpus.sources(), ev.OVERALL]
    print("threshold  " + "  ".join(f"{s[:14]:>14} P / R" for s in sources))
    for row in rows:
        cells = []
        for s in sources:
            c = row["by_source"][s]
            p = "  -  " if c["precision"] is None else f"{c['precision']:.3f}"
            cells.append(f"{p:>14} / {c['recall']:.3f}")
        print(f"{row['threshold']:>9.3f}  " + "  ".join(cells))
    chosen = choose(rows, args.target, source_targets, each_source=not args.overall_only)
    if chosen is None:
        print(f"no threshold keeps precision {args.target} (and {source_targets})")
        return 1
    overall = chosen["by_source"][ev.OVERALL]
    intervals = ev.bootstrap_intervals(
        corpus, candidates, ev.choose_by_verifier(vscores, chosen["threshold"])
    )
    spread = intervals[ev.OVERALL]
    print(
        f"chosen: threshold {chosen['threshold']:.3f}: overall precision "
        f"{overall['precision']:.3f} (95 % interval {spread.precision_low:.3f} to "
        f"{spread.precision_high:.3f}), recall {overall['recall']:.3f} "
        f"({spread.recall_low:.3f} to {spread.recall_high:.3f})"
    )
    if args.write:
        path = verifier_folder(args.verifier) / INFO_FILE
        info = json.loads(path.read_text(encoding="utf-8"))
        info["operating_point"] = {
            "threshold": chosen["threshold"],
            "chosen_on": args.pairs.name,
            "target_precision": args.target,
            "source_targets": source_targets,
            "each_source": not args.overall_only,
            "dtype": verifier.dtype,
            "by_source": chosen["by_source"],
            "intervals": {source: i.as_dict() for source, i in intervals.items()},
        }
        path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
        print(f"wrote the operating point into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
