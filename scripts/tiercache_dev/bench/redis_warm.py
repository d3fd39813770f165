"""A fresh replica warming its semantic index from Redis (tiercache.semantic.redis_rows).

Usage::

    python -m tiercache_dev.bench.redis_warm [--rows 10000,100000] [--scopes 10] [--writes 2000]

For each row count N: N synthetic rows (384 random unit floats each, spread over `--scopes`
scopes, written by another "host") are put in the deployment's stream with pipelined XADDs.
Then a fresh host (an empty state dir: its own L2 and row log) starts a `RowFollower`, and the
time from its start to "caught up" is taken: reading the stream in batches of 512 and writing
every row through the normal path (the LMDB row log, then the scopes' shared tables). Then the
host restarts: the follower resumes after the id it stored and reads nothing again.

Per-write cost: `--writes` answers written as the llm stage writes them: the local index row
(`SemanticStore.append_or_compact`, the write-back's existing step) and then the added step,
`RowSharing.publish` (read the answer's entry back from L2, XADD). Then Redis is stopped and the
publish measured again with the breaker open.

Also reported: Redis's memory per row (INFO used_memory before and after the fill).

Without `--redis-url` it starts its own redis-server (tiercache_dev.servers: a free loopback
port, no persistence) and stops it by pid at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import redis

from tiercache.config import CacheConfig
from tiercache.exact.keys import replace_secret
from tiercache.exact.redis_tier import REDIS_SEMANTIC_ROWS, Signer
from tiercache.exact.tiered import TieredCache
from tiercache.semantic.redis_rows import STREAM, RowSharing, SharedRow, sign_fields
from tiercache.semantic.row_log import scope_tag
from tiercache.semantic.store import SemanticStore
from tiercache.stages.parts import open_exact_cache
from tiercache_dev.console import exit_on_sigterm
from tiercache_dev.servers import RedisServer
from tiercache_dev.stats import summary

DIMENSIONS = 384
EMBEDDER = "bench-embedder@1"
PIPELINE_ROWS = 1000
FLEET_SECRET = bytes(range(32))  # every host of the benchmark's fleet, and the rows it writes
SIGNER = Signer(FLEET_SECRET, REDIS_SEMANTIC_ROWS)


def vectors(rng: np.random.Generator, count: int) -> np.ndarray:
    rows = rng.standard_normal((count, DIMENSIONS)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def fill_stream(url: str, prefix: str, rows: int, scopes: int, max_rows: int) -> float:
    """XADD `rows` synthetic rows of another host; Redis bytes per row."""
    client = redis.Redis.from_url(url)
    before = int(client.info("memory")["used_memory"])
    rng = np.random.default_rng(rows)
    created = time.time()
    key = prefix + STREAM
    for start in range(0, rows, PIPELINE_ROWS):
        batch = vectors(rng, min(PIPELINE_ROWS, rows - start))
        pipe = client.pipeline(transaction=False)
        for i, vector in enumerate(batch, start):
            row = SharedRow(
                f"scope-{i % scopes}",
                f"{uuid.uuid4().hex}{uuid.uuid4().hex}",
                f"synthetic prompt number {i} about a topic of some length",
                vector,
                EMBEDDER,
                created,
                0.0,
                (),
                f"tenant-{i % scopes}",
                "",
                "other-host",
            )
            fields = sign_fields(SIGNER, key, row.to_fields())  # as the fleet's hosts sign rows
            pipe.xadd(key, fields, maxlen=max_rows, approximate=True)  # type: ignore[arg-type]
        pipe.execute()
    after = int(client.info("memory")["used_memory"])
    client.close()
    return (after - before) / rows


def open_host(state: Path, url: str, prefix: str) -> tuple[TieredCache, SemanticStore, RowSharing]:
    """One host of the fleet (its state dir given the fleet's secret, as an operator copies it)."""
    if not (state / "secret").exists():
        replace_secret(state / "secret", FLEET_SECRET)
    config = CacheConfig(state_dir=str(state), l1_max_bytes=0, redis_url=url, redis_prefix=prefix)
    tiers = open_exact_cache(config)
    cache, link, listener = tiers.cache, tiers.link, tiers.listener
    store = SemanticStore(state / "semantic", 8 << 30)
    if link is None or listener is None or not listener.wait_connected(10.0):
        raise SystemExit("the invalidation listener did not connect")
    sharing = RowSharing(cache, store, link, embedder=EMBEDDER, dimensions=DIMENSIONS)
    return cache, store, sharing


def close_host(cache: TieredCache, store: SemanticStore, sharing: RowSharing) -> None:
    sharing.close()
    cache.close()
    store.close()


def catch_up(tmp: Path, url: str, rows: int, scopes: int) -> dict[str, Any]:
    prefix = f"warm{uuid.uuid4().hex[:8]}:"
    bytes_per_row = fill_stream(url, prefix, rows, scopes, max(rows, 1_000_000))
    state = tmp / f"fresh-{rows}"
    cache, store, sharing = open_host(state, url, prefix)
    started = time.perf_counter()
    sharing.start()
    if not sharing.follower.wait_caught_up(3600):
        raise SystemExit("the follower did not catch up")
    elapsed_s = time.perf_counter() - started
    stats = sharing.follower.stats()
    held = sum(store.live_count(scope_tag(f"scope-{i}")) for i in range(scopes))
    if stats.added != rows or held != rows:
        raise SystemExit(f"caught up {stats.added} rows, the log holds {held}, expected {rows}")
    close_host(cache, store, sharing)

    cache, store, sharing = open_host(state, url, prefix)  # a restart: resumes at its last id
    started = time.perf_counter()
    sharing.start()
    if not sharing.follower.wait_caught_up(600):
        raise SystemExit("the restarted follower did not catch up")
    restart_s = time.perf_counter() - started
    reread = sharing.follower.stats().read
    close_host(cache, store, sharing)
    redis.Redis.from_url(url).delete(prefix + STREAM)
    shutil.rmtree(state, ignore_errors=True)
    return {
        "rows": rows,
        "scopes": scopes,
        "catch_up_s": round(elapsed_s, 3),
        "rows_per_s": round(rows / elapsed_s),
        "restart_catch_up_s": round(restart_s, 4),
        "restart_rows_read": reread,
        "redis_bytes_per_row": round(bytes_per_row),
    }


def write_costs(
    tmp: Path, url: str, writes: int, server: RedisServer | None
) -> dict[str, dict[str, float]]:
    """The local index write vs the added publish, per answer; then the publish with Redis dead
    (only when this script started the server)."""
    prefix = f"write{uuid.uuid4().hex[:8]}:"
    cache, store, sharing = open_host(tmp / "writer", url, prefix)
    rng = np.random.default_rng(7)
    local_ms, publish_ms = [], []
    rows = vectors(rng, writes)
    for i, vector in enumerate(rows):
        digest = f"d{i:08d}"
        cache.put(digest, f"answer {i} " * 20)
        started = time.perf_counter()
        store.append_or_compact("scope-w", digest, f"prompt {i}", vector, lambda d: True)
        local = time.perf_counter()
        if not sharing.publish("scope-w", digest, f"prompt {i}", vector):
            raise SystemExit("a publish failed with Redis up")
        local_ms.append((local - started) * 1e3)
        publish_ms.append((time.perf_counter() - local) * 1e3)
    result = {"local_index_write": summary(local_ms), "publish": summary(publish_ms)}
    if server is not None:
        server.stop()
        dead_ms = []
        for i, vector in enumerate(rows[: min(writes, 1000)]):
            digest = f"d{i:08d}"
            started = time.perf_counter()
            sharing.publish("scope-w", digest, f"prompt {i}", vector)
            dead_ms.append((time.perf_counter() - started) * 1e3)
        result["publish_redis_dead"] = summary(dead_ms[1:])  # the first one finds it dead
    close_host(cache, store, sharing)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10000,100000", help="comma-separated row counts")
    parser.add_argument("--scopes", type=int, default=10, help="scopes the rows are spread over")
    parser.add_argument("--writes", type=int, default=2000, help="answers in the per-write run")
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start one)")
    args = parser.parse_args(argv)
    exit_on_sigterm()  # SIGTERM unwinds, so the servers are stopped
    counts = [int(n) for n in args.rows.split(",") if n.strip()]

    tmp = Path(tempfile.mkdtemp(prefix="bench-redis-warm-"))
    server = None
    try:
        url = args.redis_url
        if not url:
            server = RedisServer(tmp).start()
            url = server.url
        runs = [catch_up(tmp, url, rows, args.scopes) for rows in counts]
        costs = write_costs(tmp, url, args.writes, server)
    finally:
        if server is not None:
            server.stop()  # nothing when write_costs stopped it already
        shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "machine": f"{platform.machine()} {platform.system()}, Python {platform.python_version()}",
        "dimensions": DIMENSIONS,
        "catch_up": runs,
        "per_write": costs,
    }
    print(json.dumps(result, indent=2))
    print()
    for run in runs:
        print(
            f"fresh host, {run['rows']:>7} rows in {run['scopes']} scopes: caught up in "
            f"{run['catch_up_s']:.2f} s ({run['rows_per_s']} rows/s); restart re-reads "
            f"{run['restart_rows_read']} rows ({run['restart_catch_up_s'] * 1e3:.1f} ms); "
            f"Redis {run['redis_bytes_per_row']} B/row"
        )
    for name, r in costs.items():
        print(f"  {name:20s} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  n={r['n']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
