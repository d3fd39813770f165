"""Replay a stream of semantic decisions through the per-entry trust gate
(tiercache.semantic.entry_trust) and compare it with a fixed rule: does the stated error rate
hold?

Usage::

    python -m tiercache_dev.diagnostics.entry_trust_replay [--events 4000] [--max-error 0.05]
        [--seed 7]
    python -m tiercache_dev.diagnostics.entry_trust_replay --pairs PAIRS.jsonl
        [--max-error 0.05 0.1] [--orders 3] [--json OUT.json]
    python -m tiercache_dev.diagnostics.entry_trust_replay --timing [--decisions 500]

Synthetic (no `--pairs`): 40 entries, 30 good (serving them is right 99 % of the time) and 10
bad (right 40 %), offered at scores drawn uniformly in [0.9, 1.0] whatever the kind: scores that
look calibrated and are not, per entry. Prints what a fixed threshold at 0.96 serves, and what
the gate does with verification available (it explores and learns) and without.

On a pairs file (`tiercache eval-semantic`'s protocol and judging: every `a` inserted, every
`b` asked, a hit judged by duplicate clusters when the file has them): each query's candidates
the packaged guard accepts (its floor, vetoes and default threshold), best score first, go to
the gate as embedding_cache hands them (score: `SemanticGuard.calibrated`; entry: the inserted
text; a missed candidate gives way to the next). "Verification" here is the pairs' own
judgement standing in for the engine's check (or a caller's feedback): right when the
candidate is in the query's cluster. The stream is the file's order, then `--orders - 1`
shuffles. Embedding the file takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.semantic.entry_trust import Decision, LocalTrust, TrustPolicy, replay


def synthetic(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    events = []
    for _ in range(args.events):
        entry = rng.randrange(40)
        right = rng.random() < (0.99 if entry < 30 else 0.4)
        events.append((f"e{entry}", rng.uniform(0.9, 1.0), right))
    fixed = [right for _, score, right in events if score >= 0.96]
    print("| rule | served | wrong among served | verified (right / refuted) | missed |")
    print("|---|---:|---:|---:|---:|")
    wrong = len(fixed) - sum(fixed)
    print(f"| fixed threshold 0.96 | {len(fixed)} | {wrong / len(fixed):.3f} | - | "
          f"{len(events) - len(fixed)} |")  # fmt: skip
    for max_error in args.max_error:
        policy = TrustPolicy(max_error=max_error, bound_quantile=args.bound_quantile)
        for label, can_verify in (("with verification", True), ("without verification", False)):
            c = replay(policy, events, can_verify)
            served = c["served_right"] + c["served_wrong"]
            rate = c["served_wrong"] / served if served else float("nan")
            print(f"| per-entry trust, max_error {max_error}, {label} | {served} | {rate:.3f} | "
                  f"{c['verified']} / {c['refuted']} | {c['missed']} |")  # fmt: skip
    return 0


def offers(pairs_path: Path) -> tuple[list[list[tuple[int, float, bool]]], dict[str, Any]]:
    """Per query, the candidates the guard accepts, best score first: (inserted text, the
    calibrated score, whether serving it is right by the file's judgement)."""
    from tiercache.semantic import evaluate as ev
    from tiercache.semantic.embedder import Embedder
    from tiercache.semantic.guard import load_guard

    guard = load_guard()
    corpus = ev.build_corpus(ev.load_pairs(pairs_path))
    embedded = ev.embed_corpus(corpus, Embedder().embed, lambda line: print(line, file=sys.stderr))
    candidates = ev.search_topk(embedded.inserted, embedded.queries, ev.DEFAULT_K)
    scores = guard.score_matrix(ev.candidate_features(corpus, candidates))
    correct = ev.correct_candidates(corpus, candidates)
    probability = guard.calibrate(scores)
    accepted = (scores > 0.0) & (scores >= guard.threshold)
    accepted &= candidates.cosine >= guard.config.cosine_floor
    streams = []
    for i in range(len(corpus.pairs)):
        row = [j for j in np.argsort(-scores[i], kind="stable") if accepted[i, j]]
        streams.append(
            [
                (int(candidates.index[i, j]), float(probability[i, j]), bool(correct[i, j]))
                for j in row
            ]
        )
    info = {
        "pairs": len(corpus.pairs),
        "positives": int(corpus.labels.sum()),
        "judged_by": corpus.rule,
        "guard_threshold": guard.threshold,
    }
    return streams, info


def run_gate(
    streams: Sequence[list[tuple[int, float, bool]]],
    order: Sequence[int],
    policy: TrustPolicy | None,
    can_verify: bool,
    tenant_learning: bool = True,
) -> dict[str, int]:
    """Serve the queries in `order`: the guard alone (`policy` None: its best candidate) or the
    gate over its candidates, learning from every verification."""
    state = None if policy is None else LocalTrust(policy, tenant_learning)
    counts = {"served_right": 0, "served_wrong": 0, "verified": 0, "refuted": 0, "missed": 0}
    for i in order:
        outcome = "missed"
        for entry, score, right in streams[i]:
            decision = Decision.SERVE if state is None else state.decide(entry, score, can_verify)
            if decision is Decision.SERVE:
                outcome = "served_right" if right else "served_wrong"
                break
            if decision is Decision.VERIFY and state is not None:
                state.observe(entry, score, right)
                outcome = "verified" if right else "refuted"
                break
        counts[outcome] += 1
    return counts


def on_pairs(args: argparse.Namespace) -> int:
    streams, info = offers(args.pairs)
    orders = [list(range(len(streams)))]
    rng = random.Random(args.seed)
    for _ in range(args.orders - 1):
        shuffled = list(range(len(streams)))
        rng.shuffle(shuffled)
        orders.append(shuffled)
    rules: list[tuple[str, TrustPolicy | None, bool, bool]] = [
        ("guard alone (default point)", None, False, False)
    ]
    for max_error in args.max_error:
        policy = TrustPolicy(max_error=max_error, bound_quantile=args.bound_quantile)
        rules += [
            (f"max_error {max_error}, verification, entry + tenant", policy, True, True),
            (f"max_error {max_error}, verification, entry only", policy, True, False),
            (f"max_error {max_error}, no verification", policy, False, True),
        ]
    results: dict[str, list[dict[str, int]]] = {}
    for label, policy, can_verify, tenant in rules:
        results[label] = [run_gate(streams, o, policy, can_verify, tenant) for o in orders]
    offered = sum(1 for s in streams if s)
    print(f"pairs: {args.pairs.name} ({info['pairs']} queries, {offered} with a candidate the "
          f"guard accepts; judged by {info['judged_by']}; {len(orders)} orders)\n")  # fmt: skip
    print("| rule | served | wrong among served | answered right (served + verified) | "
          "verified right / refuted | missed |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, runs in results.items():
        served = [r["served_right"] + r["served_wrong"] for r in runs]
        rates = [r["served_wrong"] / s if s else 0.0 for r, s in zip(runs, served, strict=True)]
        good = [r["served_right"] + r["verified"] for r in runs]
        first = runs[0]
        spread = f" ({min(rates):.3f}-{max(rates):.3f})" if len(runs) > 1 else ""
        print(f"| {label} | {served[0]} | {rates[0]:.3f}{spread} | {good[0]} | "
              f"{first['verified']} / {first['refuted']} | {first['missed']} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"info": info, "results": results}, indent=1) + "\n")
    return 0


def timing(args: argparse.Namespace) -> int:
    """What one gate decision costs in serving: `TrustGate.decide` over a real L1 + L2 (LMDB),
    the tenant's record full (TENANT_OBSERVATIONS) and the entry's (MAX_OBSERVATIONS); the
    tenant's calibration memoized as serving keeps it, and once recomputed per decision (a
    decision right after an outcome was recorded)."""
    import hashlib
    import statistics
    import tempfile
    import time

    from tiercache.exact.stores import LmdbStore, MemoryStore
    from tiercache.exact.tiered import TieredCache
    from tiercache.semantic.entry_trust import (
        MAX_OBSERVATIONS,
        TENANT_OBSERVATIONS,
        TrustGate,
        record_outcome,
    )
    from tiercache.vocabulary import Tier

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        cache = TieredCache(
            [(Tier.L1, MemoryStore(1 << 24)), (Tier.L2, LmdbStore(Path(folder), 1 << 26))]
        )
        digest = hashlib.sha256(b"an entry").hexdigest()
        for i in range(TENANT_OBSERVATIONS):
            other = digest if i < MAX_OBSERVATIONS else hashlib.sha256(b"%d" % i).hexdigest()
            score, right = rng.uniform(0.8, 1.0), rng.random() < 0.9
            record_outcome(cache, other, score, right, "tenant", float(i + 1))
        gate = TrustGate(cache, TrustPolicy(0.05), lambda q, c, cos: 0.97)
        rows = []
        for label, memo in (("calibration memoized", True), ("calibration recomputed", False)):
            samples = []
            for _ in range(args.decisions):
                if not memo:
                    gate._calibrations.clear()
                start = time.perf_counter()
                gate.decide(digest, 0.97, "tenant", True)
                samples.append(time.perf_counter() - start)
            samples.sort()
            p99 = samples[int(0.99 * (len(samples) - 1))]
            rows.append((label, statistics.median(samples) * 1e6, p99 * 1e6))
        cache.close()
    print("| gate decision | p50 us | p99 us |\n|---|---:|---:|")
    for label, p50, p99 in rows:
        print(f"| {label} | {p50:.0f} | {p99:.0f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=Path, help="a pairs file (eval-semantic's format)")
    parser.add_argument("--events", type=int, default=4000, help="synthetic events (4000)")
    parser.add_argument("--max-error", type=float, nargs="+", default=[0.05])
    parser.add_argument("--orders", type=int, default=3, help="with --pairs: stream orders (3)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--bound-quantile",
        type=float,
        default=0.0,
        help="serve on this quantile of P(right), a credible bound (0: the predictive mean)",
    )
    parser.add_argument("--json", type=Path, help="with --pairs: write the counts here")
    parser.add_argument(
        "--timing", action="store_true", help="time the gate's decision in serving instead"
    )
    parser.add_argument("--decisions", type=int, default=500, help="with --timing (500)")
    args = parser.parse_args(argv)
    if args.timing:
        return timing(args)
    return on_pairs(args) if args.pairs is not None else synthetic(args)


if __name__ == "__main__":
    sys.exit(main())
