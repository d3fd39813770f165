"""RSS of the embedder alone over many encode calls, and what malloc_trim gives back (issue 7).

Usage::

    python -m tiercache_dev.diagnostics.embedder_rss [--batches 3000] [--every 250] [--max-batch 8]

Loads all-MiniLM-L6-v2 as the `embedder` model does (tiercache.semantic.embedder, CPU) and encodes
`--batches` batches of 1 to `--max-batch` distinct texts of 5 to 120 words (the shapes dynamic
batching hands the model), printing the process's RSS every `--every` batches. At the end it
calls glibc's malloc_trim and prints the RSS again: what the trim returns is freed memory the
allocator kept, the rest is live. The soak (docs/soak.md) saw the embedder's RSS rise about 19 MiB
over 8 minutes, slowing down.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from tiercache_dev.diagnostics.engine_rss import rss_mib

WORDS = (
    "river mountain cloud engine paper window garden market signal winter summer orange "
    "library bridge island forest planet letter number people travel coffee music simple"
).split()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=3000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--max-batch", type=int, default=8)
    args = p.parse_args(argv)

    from tiercache.memory import malloc_trim, trim_available
    from tiercache.semantic.embedder import Embedder

    embedder = Embedder("all-minilm-l6-v2", "cpu")
    rng = random.Random(0)
    started = time.monotonic()
    samples: list[float] = []
    print("batch  rss_mib  seconds")
    for i in range(args.batches):
        texts = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + f" {i}.{j}"
            for j in range(rng.randint(1, args.max_batch))
        ]
        embedder.embed(texts)
        if i % args.every == 0 or i == args.batches - 1:
            samples.append(rss_mib())
            print(f"{i:5d}  {samples[-1]:7.0f}  {time.monotonic() - started:7.0f}", flush=True)
    quarter = samples[len(samples) // 4]
    print(f"RSS growth from 25 % of the run to the end: {samples[-1] - quarter:+.1f} MiB")
    if trim_available():
        before = rss_mib()
        malloc_trim()
        print(f"malloc_trim: {before:.0f} -> {rss_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
