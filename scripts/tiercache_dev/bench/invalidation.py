"""Invalidation latency across replica processes (tiercache.exact.invalidation), on one Redis.

Usage::

    python -m tiercache_dev.bench.invalidation [--count 200] [--entries 2000] [--redis-url URL]

A second process (this module with `--child`) is a replica: its own state dir, so its own L1 and
L2, filled with `--entries` answers tagged `t0` .. `t{count-1}` in turn (so each tag covers
entries/count of them) and written through to L3. This process is the admin: for each of
`--count` tags, then for `--count` keys, it takes the time, calls `Invalidator.tag`/`.key`
(Redis TIME, record, publish; no L3 scan), and waits for the replica to report that its listener
dropped the entries from L1 and L2. Latency = the replica's clock at that report minus the
admin's clock before the call (one host, one clock). Invalidations run one at a time.

Also measured, in this process: what a tag sweep of L2 costs (`LmdbStore.scan` of every entry,
the price of having no secondary index) and the admin's L3 sweep (SCAN + MGET of this prefix).

Without `--redis-url` it starts its own redis-server (tiercache_dev.servers: a free loopback
port, no persistence) and stops it by pid at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from tiercache.config import CacheConfig
from tiercache.exact.codec import CacheEntry
from tiercache.exact.invalidation import Invalidator, sweep
from tiercache.exact.redis_tier import RedisLink, RedisStore
from tiercache.exact.stores import LmdbStore
from tiercache.exact.tiered import TieredCache
from tiercache.exact.watermarks import Invalidation
from tiercache.stages.parts import host_secret, open_exact_cache
from tiercache.vocabulary import InvalidationKind, Tier
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.servers import RedisServer
from tiercache_dev.stats import summary

MODULE = "tiercache_dev.bench.invalidation"


def child(state_dir: str, url: str, prefix: str, entries: int, tags: int) -> int:
    config = CacheConfig(state_dir=state_dir, redis_url=url, redis_prefix=prefix)
    tiers = open_exact_cache(config)
    cache = tiers.cache
    created = time.time() - 1.0
    for i in range(entries):
        cache.put(f"k{i}", f"answer {i} " * 20, tags=(f"t{i % tags}",), created_s=created)
    listener = tiers.listener
    if listener is None or not listener.wait_connected(10.0):
        print("error: listener did not connect", flush=True)
        return 1

    # When the watermark lands (reads stop serving the entries), before the sweep reclaims them.
    noted: dict[str, float] = {}
    note = cache.invalidations.note

    def timed_note(inv: Invalidation, from_redis: bool = False) -> bool:
        news = note(inv, from_redis=from_redis)
        noted.setdefault(inv.value, time.time())
        return news

    cache.invalidations.note = timed_note  # type: ignore[method-assign]

    def report(inv: Invalidation, dropped: list[str]) -> None:
        line = {"value": inv.value, "noted": noted.pop(inv.value), "t": time.time()}
        print(json.dumps({**line, "dropped": len(dropped)}), flush=True)

    listener.on_dropped(report)
    print("ready", flush=True)
    sys.stdin.read()
    cache.close()
    return 0


def measure(
    admin: Invalidator, replica: subprocess.Popen[str], kind: InvalidationKind, values: list[str]
) -> tuple[list[float], list[float]]:
    """(publish -> watermark noted, publish -> entries dropped) in ms, per invalidation."""
    assert replica.stdout is not None
    noted, dropped = [], []
    for value in values:
        started = time.time()
        admin.invalidate(kind, value, sweep_shared=False)
        line = json.loads(replica.stdout.readline())
        if line["value"] != value or line["dropped"] < 1:
            raise RuntimeError(f"unexpected report {line} for {value}")
        noted.append((line["noted"] - started) * 1e3)
        dropped.append((line["t"] - started) * 1e3)
    return noted, dropped


def sweep_costs(tmp: Path, url: str, entries: int) -> dict[str, float]:
    """One tag sweep of an L2 of `entries` entries, and an admin's L3 sweep of as many."""
    l2 = LmdbStore(tmp / "sweep-l2", 1 << 30)
    for i in range(entries):
        l2.put(f"k{i}", _entry(i))
    inv = Invalidation(InvalidationKind.TAG, "t-none", time.time())
    started = time.perf_counter()
    sweep(l2, inv)
    l2_ms = (time.perf_counter() - started) * 1e3
    l2.close()
    prefix = f"sweep{uuid.uuid4().hex[:8]}:"
    l3 = RedisStore(RedisLink.from_url(url, prefix))  # a secret of its own: it reads its own
    for i in range(entries):
        l3.put(f"k{i}", _entry(i))
    started = time.perf_counter()
    sweep(l3, inv)
    l3_ms = (time.perf_counter() - started) * 1e3
    l3.clear()
    l3.close()
    return {"l2_sweep_ms": l2_ms, "l3_sweep_ms": l3_ms, "entries": float(entries)}


def _entry(i: int) -> CacheEntry:
    return CacheEntry(f"answer {i} " * 20, time.time(), tags=(f"t{i % 200}",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200, help="invalidations of each kind")
    parser.add_argument("--entries", type=int, default=2000, help="entries in the replica")
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start one)")
    parser.add_argument("--child", nargs=4, metavar=("STATE", "URL", "PREFIX", "ENTRIES"))
    args = parser.parse_args(argv)
    if args.child:
        state, url, prefix, entries = args.child
        return child(state, url, prefix, int(entries), args.count)

    exit_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="bench-invalidation-"))
    server = None
    try:
        url = args.redis_url
        if not url:
            server = RedisServer(tmp).start()
            url = server.url
        prefix = f"bench{uuid.uuid4().hex[:8]}:"
        replica = subprocess.Popen(
            [sys.executable, "-m", MODULE, "--count", str(args.count), "--child",
             str(tmp / "replica"), url, prefix, str(args.entries)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert replica.stdout is not None and replica.stdin is not None
        if replica.stdout.readline().strip() != "ready":
            raise SystemExit("the replica process did not start")
        # the admin signs with the replica's (the fleet's) secret, read from its state dir
        secret = host_secret(tmp / "replica")
        link = RedisLink.from_url(url, prefix, timeout_s=2.0, secret=secret)
        admin = Invalidator(TieredCache([(Tier.L3, RedisStore(link))]), link)
        tags = measure(admin, replica, InvalidationKind.TAG, [f"t{i}" for i in range(args.count)])
        keys = measure(
            admin,
            replica,
            InvalidationKind.KEY,
            [f"k{i}" for i in range(args.count, min(2 * args.count, args.entries))],
        )
        replica.stdin.close()
        replica.wait(timeout=30)
        costs = sweep_costs(tmp, url, args.entries)
        link.close()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "entries_in_replica": args.entries,
        "tag_noted": summary(tags[0]),
        "tag_dropped": summary(tags[1]),
        "key_noted": summary(keys[0]),
        "key_dropped": summary(keys[1]),
        **costs,
    }
    print(json.dumps(result, indent=2))
    print(f"\npublish -> other process ({args.entries} entries in its L1+L2), one at a time:")
    for name in ("tag_noted", "tag_dropped", "key_noted", "key_dropped"):
        r = result[name]
        assert isinstance(r, dict)
        print(f"  {name:12s} p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  n={r['n']:.0f}")
    print(
        f"  (noted: reads there stop serving the entries; dropped: its sweep of L1 and L2 is "
        f"done)\n  one tag sweep of an L2 of {args.entries}: {costs['l2_sweep_ms']:.1f} ms; "
        f"of L3 (SCAN+MGET): {costs['l3_sweep_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
