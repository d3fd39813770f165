"""What the eviction policies cost per call: LRU against GreedyDual-Size-Frequency (its sketch)
and the shadow choice between the two (both orders and two sampled shadows).

Usage::

    python -m tiercache_dev.bench.policy [--keys 4000] [--calls 200000] [--rounds 5]

A policy holding `--keys` SHA-256 keys (as the KV pool's blocks and the exact cache's digests
are), then `--calls` of each operation a store makes: `access` of a held key (every hit),
`admit` of a new key with the `nominate` + `remove` that makes room for it (every miss into a
full store). The policies are timed in interleaved rounds, the same keys in the same order;
the figures are the median over rounds of the mean per call, in microseconds, with the ratios
to LRU. The point: the sketch update on a hit must stay small beside the hit path's own cost
(docs/kv_reuse.md gives the figures next to `make bench`'s hit/floor gap).

It also times the other per-response cost issue 19 put on the hit path: issuing an answer id
(tiercache.exact.answer_ids: one AES-GCM seal), and opening one (the feedback model's), in the
same rounds; and what L2's shared values (tiercache.exact.l2_values) add to an L2 read (a hit
counted in memory, written every 2 s) and to an L2 write (one more write transaction): a real
L2 in a scratch folder with and without them, the same keys (`--l2-writes` writes, then reads).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tiercache.eviction import (
    EvictionPolicy,
    GreedyDualFrequencyPolicy,
    LruPolicy,
    ShadowChoicePolicy,
)
from tiercache.exact.answer_ids import AnswerIds, AnswerRef, ServedAs
from tiercache.exact.codec import CacheEntry
from tiercache.exact.l2_values import MIN_MAP_BYTES, L2Values
from tiercache.exact.stores import LmdbStore
from tiercache_dev.console import invocation

Factory = Callable[[int], EvictionPolicy[bytes]]
FACTORIES: dict[str, Factory] = {
    "lru": lambda keys: LruPolicy(),
    "gdsf": GreedyDualFrequencyPolicy,
    "shadow": lambda keys: ShadowChoicePolicy(),  # as the KV pool builds it: no capacity told
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


def time_answer_ids(calls: int) -> dict[str, float]:
    """Microseconds per answer id issued (every response) and opened (every verdict)."""
    ids = AnswerIds(bytes(range(32)))
    scope = "a" * 64
    refs = [AnswerRef(d.hex(), ServedAs.OWN) for d in digests(min(calls, 4096))]
    started = time.perf_counter()
    issued = [ids.issue(refs[i % len(refs)], scope) for i in range(calls)]
    issue_us = (time.perf_counter() - started) * 1e6 / calls
    started = time.perf_counter()
    for answer_id in issued:
        ids.open(answer_id, scope)
    open_us = (time.perf_counter() - started) * 1e6 / calls
    return {"issue": issue_us, "open": open_us}


def time_l2(writes: int, reads: int) -> dict[str, tuple[float, float]]:
    """Microseconds per L2 write and per L2 read (a hit), without and with the values."""
    keys = [d.hex() for d in digests(writes)]
    entry = CacheEntry("an answer of about a hundred characters, " * 2, 1.0, generation_s=1.5)
    out: dict[str, list[float]] = {"write": [], "read (hit)": []}
    with tempfile.TemporaryDirectory() as folder:
        for name in ("plain", "values"):
            values = None
            if name == "values":
                values = L2Values(Path(folder) / "l2-values", MIN_MAP_BYTES)
            store = LmdbStore(Path(folder) / f"{name}-l2", 1 << 30, values=values)
            started = time.perf_counter()
            for key in keys:
                store.put(key, entry)
            out["write"].append((time.perf_counter() - started) * 1e6 / writes)
            started = time.perf_counter()
            for i in range(reads):
                store.get(keys[(i * 7919) % writes])
            out["read (hit)"].append((time.perf_counter() - started) * 1e6 / reads)
            store.close()
    return {operation: (pair[0], pair[1]) for operation, pair in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4000, help="keys held (the store's capacity)")
    parser.add_argument(
        "--calls", type=int, default=200_000, help="calls of each operation per round"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--l2-writes", type=int, default=2000, help="L2 entries written per round")
    args = parser.parse_args(argv)
    held = digests(args.keys)
    step = 7919  # a prime: reads walk the held keys in a scattered order
    reads = [held[(i * step) % len(held)] for i in range(args.calls)]
    new = digests(args.calls, start=args.keys)
    results: dict[str, dict[str, list[float]]] = {name: {} for name in FACTORIES}
    id_costs: dict[str, list[float]] = {}
    l2_costs: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for name, factory in FACTORIES.items():
            for operation, us in time_round(factory, held, reads, new).items():
                results[name].setdefault(operation, []).append(us)
        for operation, us in time_answer_ids(args.calls // 4).items():
            id_costs.setdefault(operation, []).append(us)
        for operation, pair in time_l2(args.l2_writes, args.calls // 4).items():
            l2_costs.setdefault(operation, []).append(pair)
    print(f"`{invocation('tiercache_dev.bench.policy', argv)}`")
    print(
        f"{args.keys} keys held, {args.calls} calls per operation, median of {args.rounds} rounds\n"
    )
    print("| operation | LRU us/call | GDSF us/call | shadow us/call | GDSF/LRU | shadow/LRU |")
    print("|---|---:|---:|---:|---:|---:|")
    for operation in results["lru"]:
        lru = statistics.median(results["lru"][operation])
        gdsf = statistics.median(results["gdsf"][operation])
        shadow = statistics.median(results["shadow"][operation])
        print(
            f"| {operation} | {lru:.2f} | {gdsf:.2f} | {shadow:.2f} | {gdsf / lru:.2f}x | "
            f"{shadow / lru:.2f}x |"
        )
    print("\n| answer id | us/call |\n|---|---:|")
    for operation, values in id_costs.items():
        print(f"| {operation} | {statistics.median(values):.2f} |")
    print("\n| L2 | oldest first us/call | with values us/call | ratio |\n|---|---:|---:|---:|")
    for operation, pairs in l2_costs.items():
        plain = statistics.median(p[0] for p in pairs)
        valued = statistics.median(p[1] for p in pairs)
        print(f"| {operation} | {plain:.2f} | {valued:.2f} | {valued / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
