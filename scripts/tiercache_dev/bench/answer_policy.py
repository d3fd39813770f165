"""Eviction policies for the answer tiers on the soak's realistic mix, against Belady (issue 19).

Usage::

    python -m tiercache_dev.bench.answer_policy [--entries 8000] [--seeds 0,1,2]
        [--capacities 50,100,200,400,800,1600] [--pairs FILE]

Builds the request stream `tiercache_dev.perf.soak` sends (its `build_mix`: four tenants, the
committed adapters, new questions, Zipf-popular exact repeats and rewordings) for each seed and
replays its exact keys (tenant, adapter, question) through a store holding `--capacities`
answers (one answer per slot: the mix's answers are all 8 tokens) with each of
`tiercache.eviction.NAMED_POLICIES` and Belady's optimum (`tiercache.kv_simulation`, a
request being one key). A repeat of a held key is a hit; a rewording is a miss here (the exact
tier never serves it; the embedding tier's rows are a separate store). Every miss is a
generation, so the hit ratio is also the share of generations saved. Prints one table per seed
(hit ratio, and each policy's ratio to LRU) and lines `policy <name> capacity <N> hit_ratio <x>`
for the first seed. Seed 0 is the soak's own; the others are mixes no policy was tuned on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from tiercache.eviction import NAMED_POLICIES
from tiercache.kv_simulation import replay_belady, replay_policy
from tiercache_dev.console import invocation
from tiercache_dev.paths import DEFAULT_PAIRS
from tiercache_dev.perf import soak


def key_trace(entries: int, seed: int, pairs: Path) -> list[list[int]]:
    """The mix's requests as one-key requests, each key an int per (tenant, adapter, question)."""
    args = soak.parse_args(["--entries", str(entries), "--seed", str(seed), "--pairs", str(pairs)])
    ids: dict[tuple[str, str, str], int] = {}
    return [
        [ids.setdefault((a.tenant, a.adapter, a.question), len(ids))] for a in soak.build_mix(args)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=8000, help="requests per mix")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated mix seeds")
    parser.add_argument("--capacities", default="50,100,200,400,800,1600", help="answers held")
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help="the soak's prompt pairs")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    capacities = [int(c) for c in args.capacities.split(",")]
    names = list(NAMED_POLICIES)
    print(f"`{invocation('tiercache_dev.bench.answer_policy', argv)}`\n")
    lines: list[str] = []
    for seed in seeds:
        trace = key_trace(args.entries, seed, args.pairs)
        distinct = len({request[0] for request in trace})
        print(f"mix seed {seed}: {len(trace)} requests, {distinct} distinct exact keys\n")
        print(
            "| capacity | "
            + " | ".join([*names, "belady"])
            + " | "
            + " | ".join(f"{n}/lru" for n in names if n != "lru")
            + " |"
        )
        print("|---:|" + "---:|" * (len(names) + 1 + len(names) - 1))
        for capacity in capacities:
            ratios = {
                name: replay_policy(trace, capacity, NAMED_POLICIES[name](capacity)).hit_ratio
                for name in names
            }
            ratios["belady"] = replay_belady(trace, capacity).hit_ratio
            over = [f"{ratios[n] / ratios['lru']:.2f}x" for n in names if n != "lru"]
            cells = [f"{ratios[n]:.3f}" for n in [*names, "belady"]]
            print(f"| {capacity} | " + " | ".join(cells) + " | " + " | ".join(over) + " |")
            if seed == seeds[0]:
                lines += [
                    f"policy {name} capacity {capacity} hit_ratio {ratio:.4f}"
                    for name, ratio in ratios.items()
                ]
        print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
