"""The pair verifier's time for one lookup of 5 candidates, in process (issue 18's target: p50
under 15 ms), by thread count, with the weights as trained (fp32) and with torch's dynamic int8
quantization of the linear layers (what a faster verifier could run; serving runs fp32 today).

Usage::

    python -m tiercache_dev.bench.verifier_latency --verifier .perf/verifier3
        [--pairs ../shared/eval/semantic_pairs_dev.jsonl] [--lookups 30]

Each lookup is one query (a pair's `b`) against 5 candidates (consecutive pairs' `a`), scored in
one batch, per source of the pairs file (its texts' lengths differ: gptcache-mock's sentences
are longer than qqp's questions). Prints p50 and p99 per (threads, weights, source).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from tiercache_dev.paths import DEFAULT_PAIRS

CANDIDATES = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", type=Path, required=True)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--lookups", type=int, default=30, help="per source and setting")
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
        fp32 = verifier._model
        int8 = torch.ao.quantization.quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8)
        for name, model in (("fp32", fp32), ("int8", int8)):
            verifier._model = model
            for source, data in by_source.items():
                if len(data) < need:
                    continue
                times = []
                for i in range(args.lookups):
                    texts = [data[i + j]["a"] for j in range(CANDIDATES)]
                    started = time.perf_counter()
                    verifier.scores([data[i]["b"]] * CANDIDATES, texts)
                    times.append(time.perf_counter() - started)
                p50, p99 = (1000 * float(np.percentile(times, q)) for q in (50, 99))
                print(f"| {threads} | {name} | {source} | {p50:.1f} | {p99:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
