"""Eviction policies for the engine's adapter slots (issue 19): LRU against
GreedyDual-Size-Frequency and Belady's optimum, on two adapter workloads.

Usage::

    python -m tiercache_dev.bench.adapter_policy [--requests 8000] [--adapters 32,128]
        [--alphas 0.8,1.0,1.2] [--slots 4,8,16] [--seed 1]

No public trace says which LoRA adapter each request named, so the workloads are the model the
multi-adapter serving papers evaluate with (S-LoRA, Punica: adapter popularity by a power law),
in two shapes:

- `independent`: each request picks its adapter by Zipf(`alpha`) over `--adapters` adapters
  (popularity ranks shuffled by the seed);
- `sessions`: eight conversations are open at once, each on one adapter picked the same way;
  each request comes from one of them at random, and a conversation ends after a request with
  probability 0.2 (five requests on average) and a new one starts: the same popularity with the
  temporal locality of chat sessions.

Each trace runs through a store of `--slots` equal slots (lora_cache's engine tier bounded by
`engine_slots`; every adapter one slot and one load, so hit ratio = loads saved) with each policy
(`tiercache.eviction.NAMED_POLICIES`, through `MemoryStore` as the answer benchmark replays) and
Belady's optimum. Prints one table per workload: hit ratio per policy and GDSF/LRU.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable, Sequence

from tiercache.eviction import NAMED_POLICIES
from tiercache_dev.bench.answer_policy import replay_fewest_misses, replay_store
from tiercache_dev.console import invocation

Picker = Callable[[], int]


def zipf_picker(adapters: int, alpha: float, rng: random.Random) -> Picker:
    ranks = list(range(adapters))
    rng.shuffle(ranks)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(adapters)]
    choices = range(adapters)
    return lambda: ranks[rng.choices(choices, weights)[0]]


def independent(requests: int, pick: Picker, rng: random.Random) -> list[int]:
    return [pick() for _ in range(requests)]


def sessions(
    requests: int, pick: Picker, rng: random.Random, open_at_once: int = 8, end: float = 0.2
) -> list[int]:
    live = [pick() for _ in range(open_at_once)]
    out = []
    for _ in range(requests):
        slot = rng.randrange(open_at_once)
        out.append(live[slot])
        if rng.random() < end:
            live[slot] = pick()
    return out


WORKLOADS = {"independent": independent, "sessions": sessions}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--adapters", default="32,128", help="adapters in the registry")
    parser.add_argument("--alphas", default="0.8,1.0,1.2", help="Zipf exponents of popularity")
    parser.add_argument("--slots", default="4,8,16", help="engine adapter slots")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    counts = [int(a) for a in args.adapters.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    slots = [int(s) for s in args.slots.split(",")]
    print(f"`{invocation('tiercache_dev.bench.adapter_policy', argv)}`\n")
    for workload, make in WORKLOADS.items():
        print(f"{workload}: {args.requests} requests, hit ratio (GDSF / LRU)\n")
        print("| adapters | alpha | " + " | ".join(f"{s} slots" for s in slots) + " |")
        print("|---:|---:|" + "---|" * len(slots))
        for count in counts:
            for alpha in alphas:
                rng = random.Random(args.seed)
                trace = make(args.requests, zipf_picker(count, alpha, rng), rng)
                costs = [1.0] * count
                cells = []
                for slot_count in slots:
                    hits = {
                        name: replay_store(trace, slot_count, factory(slot_count), costs).hits
                        for name, factory in NAMED_POLICIES.items()
                    }
                    best = replay_fewest_misses(trace, slot_count, costs).hits
                    n = len(trace)
                    cells.append(
                        f"LRU {hits['lru'] / n:.3f}, GDSF {hits['gdsf'] / n:.3f} "
                        f"({hits['gdsf'] / hits['lru']:.2f}x), Belady {best / n:.3f}"
                    )
                print(f"| {count} | {alpha:g} | " + " | ".join(cells) + " |")
                sys.stdout.flush()
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
