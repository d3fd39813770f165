"""What an L3 (Redis) read or write costs with Redis up and with Redis dead, next to an L2 read.

Usage::

    python -m tiercache_dev.bench.redis_tier [--reads 100000] [--json]

Starts its own redis-server (tiercache_dev.servers: a free loopback port, no persistence), times
`RedisStore.get` (hit and miss) and `put` with it up, kills it, times the first call after the
kill (the one that finds the connection refused and opens the breaker), then `--reads` reads and
1,000 writes with the breaker open. An `LmdbStore` read hit on the same entry is timed in the same
run, so every figure is also printed as a ratio to it. The point of the breaker: a dead Redis
costs a clock read per call, not a socket timeout (`timeout_s`, 0.25 s).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from tiercache.exact.codec import CacheEntry
from tiercache.exact.redis_tier import RedisLink, RedisStore
from tiercache.exact.stores import LmdbStore
from tiercache_dev.console import invocation
from tiercache_dev.servers import RedisServer
from tiercache_dev.stats import summary


def timed_us(call: Callable[[int], object], count: int) -> list[float]:
    times = []
    for i in range(count):
        started = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - started) * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=100_000, help="reads with Redis dead")
    parser.add_argument("--up-reads", type=int, default=3_000, help="reads with Redis up")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="tiercache-redis-tier-bench-"))
    server = RedisServer(tmp / "redis").start()
    try:
        link = RedisLink.from_url(server.url, f"bench{uuid.uuid4().hex[:8]}:", retry_s=60.0)
        l3 = RedisStore(link)
        l2 = LmdbStore(tmp / "l2", 1 << 26)
        entry = CacheEntry("an answer of a few words " * 8, created_s=time.time() - 1)
        l3.put("hit", entry)
        l2.put("hit", entry)
        figures: dict[str, dict[str, float]] = {}
        figures["L2 read hit (LMDB, the reference)"] = summary(
            timed_us(lambda i: l2.get("hit"), args.up_reads), "us", 2
        )
        figures["L3 read hit, Redis up"] = summary(
            timed_us(lambda i: l3.get("hit"), args.up_reads), "us", 2
        )
        figures["L3 read miss, Redis up"] = summary(
            timed_us(lambda i: l3.get(f"missing{i}"), args.up_reads), "us", 2
        )
        figures["L3 write, Redis up"] = summary(
            timed_us(lambda i: l3.put(f"w{i}", entry), 1_000), "us", 2
        )
        server.stop()
        figures["first call after the kill (refused; opens the breaker)"] = summary(
            timed_us(lambda i: l3.get("hit"), 1), "us", 2
        )
        figures["L3 read, Redis dead (breaker open)"] = summary(
            timed_us(lambda i: l3.get(f"missing{i}"), args.reads), "us", 2
        )
        figures["L3 write, Redis dead (breaker open)"] = summary(
            timed_us(lambda i: l3.put(f"d{i}", entry), 1_000), "us", 2
        )
        health = link.health()
        if health.available or health.short_circuits < args.reads:
            raise SystemExit(f"the breaker did not short-circuit the dead reads: {health}")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    reference = figures["L2 read hit (LMDB, the reference)"]["p50_us"]
    if args.json:
        print(json.dumps({"figures": figures, "short_circuits": health.short_circuits}, indent=1))
        return 0
    print(f"\n## L3 costs, Redis up and dead ({time.strftime('%Y-%m-%d')})\n")
    print(f"- command: `{invocation('tiercache_dev.bench.redis_tier', argv)}`")
    print(f"- reads answered by the open breaker: {health.short_circuits:,}\n")
    print("| what | n | p50 us | p99 us | p50 / L2 read p50 |\n|---|---:|---:|---:|---:|")
    for label, s in figures.items():
        ratio = s["p50_us"] / reference if reference else float("nan")
        print(f"| {label} | {s['n']:,} | {s['p50_us']:.1f} | {s['p99_us']:.1f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
