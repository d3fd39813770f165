"""What the eviction policies cost per call: LRU against GreedyDual-Size-Frequency (its sketch).

Usage::

    python -m tiercache_dev.bench.policy [--keys 4000] [--calls 200000] [--rounds 5]

A policy holding `--keys` SHA-256 keys (as the KV pool's blocks and the exact cache's digests
are), then `--calls` of each operation a store makes: `access` of a held key (every hit),
`admit` of a new key with the `nominate` + `remove` that makes room for it (every miss into a
full store). Both policies are timed in interleaved rounds, the same keys in the same order;
the figures are the median over rounds of the mean per call, in microseconds, with the ratio
GDSF/LRU. The point: the sketch update on a hit must stay small beside the hit path's own cost
(docs/kv_reuse.md gives the figures next to `make bench`'s hit/floor gap).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

from tiercache.eviction import EvictionPolicy, GreedyDualFrequencyPolicy, LruPolicy
from tiercache_dev.console import invocation

Factory = Callable[[int], EvictionPolicy[bytes]]
FACTORIES: dict[str, Factory] = {
    "lru": lambda keys: LruPolicy(),
    "gdsf": GreedyDualFrequencyPolicy,
}


def digests(count: int, start: int = 0) -> list[bytes]:
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(start, start + count)]


def time_round(
    factory: Factory, held: list[bytes], reads: list[bytes], new: list[bytes]
) -> dict[str, float]:
    policy = factory(len(held))
    for key in held:
        policy.admit(key, 1)
    started = time.perf_counter()
    for key in reads:
        policy.access(key)
    access_us = (time.perf_counter() - started) * 1e6 / len(reads)
    started = time.perf_counter()
    for key in new:
        for victim in policy.nominate(1):
            policy.remove(victim)
        policy.admit(key, 1)
    miss_us = (time.perf_counter() - started) * 1e6 / len(new)
    return {"access": access_us, "admit with eviction": miss_us}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4000, help="keys held (the store's capacity)")
    parser.add_argument(
        "--calls", type=int, default=200_000, help="calls of each operation per round"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    held = digests(args.keys)
    step = 7919  # a prime: reads walk the held keys in a scattered order
    reads = [held[(i * step) % len(held)] for i in range(args.calls)]
    new = digests(args.calls, start=args.keys)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in FACTORIES}
    for _ in range(args.rounds):
        for name, factory in FACTORIES.items():
            for operation, us in time_round(factory, held, reads, new).items():
                results[name].setdefault(operation, []).append(us)
    print(f"`{invocation('tiercache_dev.bench.policy', argv)}`")
    print(
        f"{args.keys} keys held, {args.calls} calls per operation, median of {args.rounds} rounds\n"
    )
    print("| operation | LRU us/call | GDSF us/call | GDSF/LRU |")
    print("|---|---:|---:|---:|")
    for operation in results["lru"]:
        lru = statistics.median(results["lru"][operation])
        gdsf = statistics.median(results["gdsf"][operation])
        print(f"| {operation} | {lru:.2f} | {gdsf:.2f} | {gdsf / lru:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
