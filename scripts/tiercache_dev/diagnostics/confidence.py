"""Does an answer's confidence say whether it may be served to a rewording? (issue 19)

Usage::

    python -m tiercache_dev.diagnostics.confidence [--pairs ../shared/eval/semantic_pairs_dev.jsonl]
        [--count 200] [--max-tokens 32] [--threads 2] [--out-dir .perf]

A semantic hit serves the answer generated for one prompt (`a`) to a rewording of it (`b`). It
is right when `b`'s own answer would say the same. For `--count` rewording pairs (label 1, every
k-th row, so both sources are in), the CPU engine answers `a` and `b` greedily (as the cache
would hold them) and reports each answer's confidence: exp(mean token log-probability), the
geometric-mean probability of its tokens (tiercache.engine: every picked token's, its end
included). Agreement of the two answers: token F1 of their lower-cased words (1.0: the same
words), and exact equality.

The pairs are split by a hash of `a` into a tuning half and a held-out half. For each floor on
the stored answer's confidence, it prints what share of answers is kept (coverage) and the mean
agreement of kept and dropped pairs, on both halves: a floor is worth having if the answers it
drops agree much less than those it keeps, on the half it was not chosen on too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tiercache_dev.console import invocation, progress, write_report
from tiercache_dev.paths import DEFAULT_PAIRS

FLOORS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
_WORD = re.compile(r"\w+")


@dataclass
class Pair:
    a: str
    b: str
    held_out: bool
    answer_a: str = ""
    answer_b: str = ""
    confidence_a: float = 0.0
    confidence_b: float = 0.0

    @property
    def f1(self) -> float:
        return token_f1(self.answer_a, self.answer_b)


def token_f1(x: str, y: str) -> float:
    """Token F1 of the lower-cased words of `x` and `y` (1.0 when both are empty)."""
    wx, wy = _WORD.findall(x.lower()), _WORD.findall(y.lower())
    if not wx and not wy:
        return 1.0
    common = sum((Counter(wx) & Counter(wy)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(wx), common / len(wy)
    return 2 * precision * recall / (precision + recall)


def read_pairs(path: Path, count: int) -> list[Pair]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    positives = [r for r in rows if r["label"] == 1 and r["a"].strip() != r["b"].strip()]
    step = max(1, len(positives) // count)
    chosen = positives[::step][:count]
    return [
        Pair(r["a"], r["b"], hashlib.sha256(r["a"].encode()).digest()[0] % 2 == 1) for r in chosen
    ]


def floor_rows(pairs: Sequence[Pair]) -> list[dict[str, float]]:
    rows = []
    for floor in FLOORS:
        kept = [p for p in pairs if p.confidence_a >= floor]
        dropped = [p for p in pairs if p.confidence_a < floor]
        rows.append(
            {
                "floor": floor,
                "coverage": len(kept) / len(pairs) if pairs else 0.0,
                "kept_f1": statistics.fmean(p.f1 for p in kept) if kept else math.nan,
                "dropped_f1": statistics.fmean(p.f1 for p in dropped) if dropped else math.nan,
                "kept_same": (
                    sum(p.answer_a == p.answer_b for p in kept) / len(kept) if kept else math.nan
                ),
            }
        )
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--count", type=int, default=200, help="rewording pairs answered")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--state-dir", type=Path, default=Path(".tiercache"))
    parser.add_argument("--out-dir", type=Path, default=Path(".perf"))
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from tiercache.engine.model_source import resolve_model
    from tiercache.engine.torch_engine import TorchEngine
    from tiercache.exact.request import GenerationRequest

    pairs = read_pairs(args.pairs, args.count)
    torch.set_num_threads(args.threads)
    progress(f"loading the engine ({args.threads} threads); {len(pairs)} pairs")
    engine = TorchEngine(resolve_model(), args.state_dir / "models", "cpu", 2, kv_reuse=False)
    engine.speculate = False

    def answer(prompt: str) -> tuple[str, float]:
        events = list(engine.generate(GenerationRequest(prompt, max_tokens=args.max_tokens)))
        mean = events[-1].mean_logprob
        return "".join(e.text for e in events), math.exp(mean) if mean is not None else 0.0

    for i, pair in enumerate(pairs, 1):
        pair.answer_a, pair.confidence_a = answer(pair.a)
        pair.answer_b, pair.confidence_b = answer(pair.b)
        if i % 10 == 0 or i == len(pairs):
            progress(f"  {i}/{len(pairs)} pairs answered")

    halves = {
        "tuning": [p for p in pairs if not p.held_out],
        "held-out": [p for p in pairs if p.held_out],
    }
    lines = [
        f"`{invocation('tiercache_dev.diagnostics.confidence', argv)}`",
        "",
        f"{len(pairs)} rewording pairs (label 1), greedy answers of at most {args.max_tokens} "
        "tokens; confidence = exp(mean token log-probability) of the stored answer (`a`'s); "
        "agreement = token F1 of `a`'s and `b`'s answers.",
        "",
        "| half | floor | answers kept | F1 kept | F1 dropped | identical kept |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    summary: dict[str, object] = {"pairs": len(pairs), "max_tokens": args.max_tokens}
    for name, half in halves.items():
        rows = floor_rows(half)
        summary[name] = rows
        for r in rows:
            lines.append(
                f"| {name} ({len(half)}) | {r['floor']:.1f} | {r['coverage']:.0%} | "
                f"{r['kept_f1']:.3f} | {r['dropped_f1']:.3f} | {r['kept_same']:.0%} |"
            )
    confidences = sorted(p.confidence_a for p in pairs)
    quartiles = statistics.quantiles(confidences, n=4) if len(confidences) > 1 else confidences
    lines += ["", f"confidence quartiles: {', '.join(f'{q:.3f}' for q in quartiles)}"]
    summary["quartiles"] = quartiles
    summary["answers"] = [
        {"a": p.a, "b": p.b, "conf_a": p.confidence_a, "conf_b": p.confidence_b, "f1": p.f1}
        for p in pairs
    ]
    markdown = "\n".join(lines)
    write_report(args.out_dir, "confidence", markdown, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
